"""Data-parallel replicas of a pipeline: who is which replica's which pipeline rank, and which slice
of every backward sub-stage each replica's optimizer owns (pure data, no communication).

A job of ``world = R x P`` processes is R replicas of a P-rank pipeline. Ranks are numbered node by
node, and replica ``r`` is the processes ``r*P .. r*P+P-1``, so a pipeline's ranks are neighbours:
with P equal to the GPUs of a node, replicas lie across nodes (a pipeline's ranks share one node's
shared memory); with fewer, several replicas share a node. Every replica runs the same schedule on
its own micro-batches. The R ranks that hold pipeline rank ``p`` (one per replica) own the same
backward sub-stages and split each one's fp32 master and Adam state into R contiguous shards
(:func:`shard_range`), shard ``r`` stepped by replica ``r``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn


def shard_range(numel: int, shards: int, index: int) -> range:
    """Elements ``[lo, hi)`` of a flat buffer of ``numel`` that shard ``index`` of ``shards`` owns:
    contiguous, as equal as possible (the first ``numel % shards`` are one longer), covering the
    buffer exactly once. Every rank computes the same cut from the same three numbers."""
    if shards < 1 or not 0 <= index < shards:
        raise ValueError(f"shard {index} of {shards}: need shards >= 1 and 0 <= index < shards")
    base, extra = divmod(numel, shards)
    lo = index * base + min(index, extra)
    return range(lo, lo + base + (1 if index < extra else 0))


@dataclass(frozen=True)
class ReplicaLayout:
    """Where global rank ``rank`` of ``replicas x pipeline`` processes sits (see the module doc).

    ``local_world_size``: processes per node (ranks are numbered node by node)."""

    replicas: int
    pipeline: int  # P: ranks per replica
    rank: int = 0  # this process's global rank
    local_world_size: int = 1

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.pipeline < 1:
            raise ValueError(f"replicas={self.replicas} and pipeline={self.pipeline} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside {self.replicas} x {self.pipeline} processes")

    @classmethod
    def of(cls, replicas: int, world_size: int, *, rank: int = 0, local_world_size: int = 1) -> ReplicaLayout:
        """The layout of ``world_size`` processes as ``replicas`` pipelines; :class:`ValueError` in one
        line (the bad values and the fix) when ``replicas`` does not divide ``world_size``."""
        if replicas < 1 or world_size % replicas:
            raise ValueError(
                f"parallel.replicas={replicas} does not divide the {world_size} processes of the job: the world "
                f"size must be replicas x pipeline ranks; start a multiple of {replicas} processes or set "
                f"parallel.replicas to a divisor of {world_size}"
            )
        return cls(replicas, world_size // replicas, rank, local_world_size)

    @property
    def world_size(self) -> int:
        """Every process of the job."""
        return self.replicas * self.pipeline

    @property
    def replica(self) -> int:
        """This process's replica."""
        return self.rank // self.pipeline

    @property
    def stage_rank(self) -> int:
        """This process's rank inside its pipeline (the rank its schedule's op list belongs to)."""
        return self.rank % self.pipeline

    def global_rank(self, stage_rank: int, replica: int | None = None) -> int:
        """The global rank of pipeline rank ``stage_rank`` of ``replica`` (default: this one)."""
        return (self.replica if replica is None else replica) * self.pipeline + stage_rank

    def peers(self, stage_rank: int | None = None) -> list[int]:
        """The global ranks holding pipeline rank ``stage_rank`` (default: this one's), one per replica,
        in replica order: the group that reduces its sub-stages' gradients and shares their shards."""
        p = self.stage_rank if stage_rank is None else stage_rank
        return [r * self.pipeline + p for r in range(self.replicas)]

    def node_of(self, rank: int) -> int:
        """The node global ``rank`` runs on."""
        return rank // self.local_world_size

    def peers_share_node(self) -> bool:
        """True when every replica's copy of a pipeline rank runs on one node: gradients meet in
        that node's shared memory and the updated shards need no network."""
        return len({self.node_of(r) for r in self.peers()}) == 1

    @property
    def reduction(self) -> str:
        """How a sub-stage's gradients meet: ``none`` (one replica), ``node`` (every peer on this
        node: through its shared memory) or ``network`` (one peer per node: collectives).
        :class:`ValueError` in one line for a layout that mixes both (some peers share a node)."""
        if self.replicas == 1:
            return "none"
        nodes = [self.node_of(r) for r in self.peers()]
        if len(set(nodes)) == 1:
            return "node"
        if len(set(nodes)) == len(nodes):
            return "network"
        return self._mixed(nodes)

    def _mixed(self, nodes: list[int]) -> NoReturn:
        n_nodes = -(-self.world_size // self.local_world_size)
        raise ValueError(
            f"parallel.replicas={self.replicas} of {self.pipeline} pipeline ranks puts "
            f"{nodes.count(nodes[0])} replicas on a node and the rest on other nodes, a layout sysx does not "
            f"reduce gradients across; set parallel.replicas={n_nodes} (one replica per node) or run every "
            f"replica on one node"
        )

    def turns(self, n: int) -> int:
        """Of ``n`` micro-batches shared out in turns (replica ``r`` takes ``r, r+R, ...``), how many are this replica's."""
        return len(range(self.replica, n, self.replicas))

    def shard(self, numel: int) -> range:
        """The elements of a sub-stage of ``numel`` parameters this replica's optimizer owns."""
        return shard_range(numel, self.replicas, self.replica)

    def describe(self) -> str:
        """``2 replicas x 4 pipeline ranks (replica 1, pipeline rank 3)``."""
        return (
            f"{self.replicas} replica(s) x {self.pipeline} pipeline rank(s) "
            f"(replica {self.replica}, pipeline rank {self.stage_rank})"
        )
