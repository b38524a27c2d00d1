"""What replicas of a pipeline exchange (:mod:`sysx.replicas`): each backward sub-stage's gradients,
reduced so that every replica holds the sum of its shard, and the updated 16-bit shards.

:class:`GradReducer` runs one thread per rank that takes the rank's offloaded sub-stages in backward
order (the same order on every replica, so collectives pair up), waits for each offload and reduces
it: through the node's shared memory when every replica of this pipeline rank runs on the node (the
landing buffers are segments; a barrier on the replica group says they are full, then each replica
adds the others' slices of its shard into its own), else with one ``reduce`` per shard over the
replica group (a reduce-scatter whose shards may differ by one element). The sums are fp32
whatever the precision, and land in the stage optimizer's own gradient buffer (in fp32 runs the
shard's slice of the landing buffer itself), so replicas add no gradient copy.
The unit's optimizer job waits on :class:`Reduced` instead of the offload's event, so the CPU Adam
thread steps its shard as soon as the reduction is done, overlapped with the next sub-stage's
backward, and the compute stream never waits for the network.

:func:`exchange_shards` sends every replica's updated 16-bit shards to the other nodes after the
step's validation (replicas on one node wrote theirs into the one shared segment already).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sysx import device as dev
from sysx.dist import wait_for
from sysx.emulate.pacer import Pacer
from sysx.partition import unit_label
from sysx.replicas import ReplicaLayout, shard_range

Unit = tuple[int, int]


@dataclass(frozen=True)
class ReplicaGroups:
    """The gloo groups of the replicas of each pipeline rank: ``reduce`` for the gradient
    reductions (the reducer thread), ``exchange`` for the shard exchange (the main thread)."""

    reduce: dist.ProcessGroup
    exchange: dist.ProcessGroup

    @classmethod
    def build(cls, layout: ReplicaLayout) -> ReplicaGroups:
        """Collective over the whole job: every rank creates every pipeline rank's groups, in one order."""
        mine: ReplicaGroups | None = None
        for p in range(layout.pipeline):
            ranks = layout.peers(p)
            groups = cls(dist.new_group(ranks, backend="gloo"), dist.new_group(ranks, backend="gloo"))
            if p == layout.stage_rank:
                mine = groups
        assert mine is not None
        return mine


class Reduced(dev.Event):
    """The event an optimizer job waits on: its unit's reduction is done (or failed: raised here);
    recorded, as a host event, when the sum is in place."""

    def __init__(self, unit: Unit) -> None:
        super().__init__(torch.device("cpu"))
        self.unit = unit
        self._done = threading.Event()
        self.error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        """The reduction ended (``error``: how it failed)."""
        self.error = error
        self.record()
        self._done.set()

    def query(self) -> bool:
        """Whether the reduction ended."""
        return self._done.is_set()

    def synchronize(self) -> None:
        """Wait for the reduction; re-raise its failure in the waiting thread."""
        self._done.wait()
        if self.error is not None:  # as raised (a stop, a peer's failure or timeout names itself)
            raise self.error


class GradReducer:
    """The cross-replica gradient reduction of one rank's owned sub-stages (see the module doc).

    ``landing``: each owned unit's full host gradient buffer (what its OFFLOAD_GRADS fills);
    ``peers_landing``: on the ``node`` path, every replica's buffer of each unit (views of the
    node's segments, in replica order); ``reduced``: each unit's fp32 shard the sums go into."""

    def __init__(
        self,
        layout: ReplicaLayout,
        landing: Mapping[Unit, torch.Tensor],
        reduced: Mapping[Unit, torch.Tensor],
        *,
        group: dist.ProcessGroup,
        timeout_s: float,
        pacer: Pacer | None = None,
        peers_landing: Mapping[Unit, Sequence[torch.Tensor]] | None = None,
    ) -> None:
        self.layout, self.landing, self.reduced = layout, landing, reduced
        self.path = layout.reduction
        if self.path == "node" and peers_landing is None:
            raise ValueError("the node path reduces in shared memory: give every replica's landing buffers")
        self.peers_landing = peers_landing or {}
        self.group, self.timeout_s, self.pacer = group, timeout_s, pacer or Pacer()
        self.done: dict[Unit, Reduced] = {}
        self._jobs: queue.Queue[tuple[Unit, dev.Event | None] | None] = queue.Queue()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"sysx-reduce-r{layout.rank}", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        """A new step: forget the previous step's reductions."""
        self.done = {}

    def submit(self, unit: Unit, offload: dev.Event | None) -> Reduced:
        """Reduce ``unit`` once ``offload`` (its gradients' copy to the host) is done; returns what
        its optimizer job waits on."""
        done = self.done[unit] = Reduced(unit)
        self._jobs.put((unit, offload))
        return done

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            unit, offload = job
            done = self.done.get(unit)
            try:
                if self._failed is not None:
                    raise self._failed  # a collective out of step with the peers would hang: fail the rest
                if offload is not None:
                    offload.synchronize()
                with self.pacer.replica_reduce(unit_label(*unit), offload):
                    self._reduce(unit)
            except BaseException as err:  # handed to the optimizer job, which raises it on its thread
                self._failed = err
                if done is not None:
                    done.set(err)
                continue
            if done is not None:
                done.set()

    def _reduce(self, unit: Unit) -> None:
        full = self.landing[unit]
        numel, mine = full.numel(), self.layout.shard(full.numel())
        out = self.reduced[unit]
        in_place = out.data_ptr() == full[mine.start : mine.stop].data_ptr()  # fp32: the shard's own slice
        what = f"gradient reduction of {unit_label(*unit)} across {self.layout.replicas} replicas"
        if self.path == "node":
            self._wait(dist.barrier(group=self.group, async_op=True), what)  # every replica's offload is in
            views = self.peers_landing[unit]
            if not in_place:
                out.copy_(views[self.layout.replica][mine.start : mine.stop])
            for j, view in enumerate(views):  # the others only read their own shards of this buffer
                if j != self.layout.replica:
                    out.add_(view[mine.start : mine.stop])
            return
        if full.dtype != torch.float32:
            full = full.float()
        works = []
        for j, dst in enumerate(self.layout.peers()):
            cut = shard_range(numel, self.layout.replicas, j)
            works.append(dist.reduce(full[cut.start : cut.stop], dst=dst, group=self.group, async_op=True))
        for work in works:
            self._wait(work, what)
        if not in_place:
            out.copy_(full[mine.start : mine.stop])

    def _wait(self, work: dist.Work | None, what: str) -> None:
        assert work is not None
        wait_for(work, rank=self.layout.rank, what=what, peer=None, timeout_s=self.timeout_s, collective=True)

    def close(self) -> None:
        """Stop the thread once the queued reductions are done (bounded by the timeout)."""
        self._jobs.put(None)
        self._thread.join(timeout=self.timeout_s)


def exchange_shards(
    layout: ReplicaLayout,
    shared: Mapping[Unit, torch.Tensor],
    units: Sequence[Unit],
    *,
    group: dist.ProcessGroup,
    timeout_s: float,
    pacer: Pacer | None = None,
) -> int:
    """Every replica's updated shard of each of ``units`` (in this order on every replica) into the
    other replicas' copies (``shared``: this node's 16-bit working copy of each unit), one broadcast
    per shard over the replica ``group``. Nothing on the ``node`` path. Returns the bytes received."""
    if layout.reduction != "network":
        return 0
    received = sum(shared[u].element_size() * (shared[u].numel() - len(layout.shard(shared[u].numel()))) for u in units)
    with (pacer or Pacer()).replica_gather(received):
        works = []
        for unit in units:
            full = shared[unit]
            for j, src in enumerate(layout.peers()):
                cut = shard_range(full.numel(), layout.replicas, j)
                works.append(dist.broadcast(full[cut.start : cut.stop], src=src, group=group, async_op=True))
        for work in works:
            assert work is not None
            wait_for(
                work,
                rank=layout.rank,
                what="exchange of the updated parameter shards between replicas",
                peer=None,
                timeout_s=timeout_s,
                collective=True,
            )
    return received


def gather_shards(
    shard: torch.Tensor,
    *,
    cuts: Sequence[range],
    ranks: Sequence[int],
    root: int,
    rank: int,
    group: dist.ProcessGroup,
    timeout_s: float,
) -> torch.Tensor | None:
    """The full flat buffer whose shards ``ranks`` hold (``ranks[j]`` holds elements ``cuts[j]``;
    ``shard``: this rank's) on ``root``, None elsewhere (collective over ``group``, whose ranks are
    ``ranks``: a replica group, or a spread step's sharers; for saves and tests, not the hot path).
    Shards are padded to one size for ``gather``."""
    size = max(len(c) for c in cuts)
    padded = torch.zeros(size, dtype=shard.dtype)
    padded[: shard.numel()].copy_(shard)
    parts = [torch.empty_like(padded) for _ in ranks] if rank == root else None
    work = dist.gather(padded, parts, dst=root, group=group, async_op=True)
    assert work is not None
    what = f"gather of the shards of ranks {list(ranks)}"
    wait_for(work, rank=rank, what=what, peer=None, timeout_s=timeout_s, collective=True)
    if parts is None:
        return None
    return torch.cat([part[: len(cut)] for cut, part in zip(cuts, parts, strict=True)])
