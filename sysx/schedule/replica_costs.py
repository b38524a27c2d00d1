"""What R data-parallel replicas of a pipeline add to its cost table (pure data).

Every replica runs the same P-rank schedule; the R ranks holding one pipeline rank reduce each
backward sub-stage's fp32 gradients after its offload (one reducer thread per rank, units in
backward order), then each steps only its 1/R shard of the unit (the optimizer time / R), and after
the step's validation the updated 16-bit shards are exchanged between nodes. Peers on one node meet
in its shared memory: the reduction is host memory traffic (each shard owner reads R buffers'
slices of its shard and writes the sum) and nothing is exchanged (the shards are written into the
one shared segment). Peers on different nodes reduce-scatter over the inter-node link: each rank
sends and receives ``(R-1)/R`` of the unit's fp32 bytes, and receives ``(R-1)/R`` of its 16-bit
bytes in the exchange.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sysx.memory.node_plan import UnitPlace

if TYPE_CHECKING:  # a type only: ops imports nothing of this package's costs
    from sysx.schedule.ops import Schedule

# host memory bytes a CPU Adam step moves per parameter (sysx.config.choices: ASSUMED_CPUS' rates
# are a node's memory bandwidth over this): a reducer thread is taken to sum at one Adam thread's
# bandwidth, this times its parameters per second
ADAM_BYTES_PER_PARAM = 30.0


@dataclass(frozen=True)
class ReplicaCosts:
    """The replicas of a pipeline and the links their reduction and exchange run over.

    ``share_node``: all R peers of a pipeline rank run on one node. ``link_bandwidth`` /
    ``link_latency``: one rank's share of the inter-node link (bytes/s, s). ``memory_bandwidth``:
    bytes/s one reducer thread reads and writes host memory at. ``grad_bytes``: the reduced
    gradients' element size (fp32); ``param_bytes``: the exchanged working copy's."""

    replicas: int
    share_node: bool
    link_bandwidth: float
    link_latency: float
    memory_bandwidth: float
    grad_bytes: float = 4.0
    param_bytes: float = 2.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"ReplicaCosts.replicas={self.replicas} must be >= 1")
        for name in ("link_bandwidth", "memory_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ReplicaCosts.{name}={getattr(self, name)!r} must be > 0")

    def reduce_seconds(self, numel: float) -> float:
        """The reduction of one unit of ``numel`` parameters among the R peers (0 at R=1)."""
        r = self.replicas
        if r == 1:
            return 0.0
        if self.share_node:  # the shard owner reads R slices of numel/R and writes their sum
            return numel / r * (r + 1) * self.grad_bytes / self.memory_bandwidth
        return self.link_latency + (r - 1) / r * numel * self.grad_bytes / self.link_bandwidth

    def gather_bytes(self, numel: float) -> float:
        """16-bit bytes one rank receives for an owned unit of ``numel`` in the exchange (0 on one node)."""
        r = self.replicas
        return 0.0 if r == 1 or self.share_node else (r - 1) / r * numel * self.param_bytes

    def gather_seconds(self, nbytes: float) -> float:
        """One exchange of ``nbytes`` received by a rank (0 when nothing moves)."""
        return self.link_latency + nbytes / self.link_bandwidth if nbytes > 0 else 0.0


def schedule_units(schedule: Schedule, layer_numels: Sequence[float]) -> list[UnitPlace]:
    """Every backward sub-stage of ``schedule`` with its parameters and pipeline ranks."""
    p, place = schedule.partition, schedule.assignment
    return [
        UnitPlace(int(sum(layer_numels[i] for i in p.sub_layers(s, k))), place.bwd_rank[s][k], place.fwd_rank[s])
        for s in range(p.n_stages)
        for k in range(p.split)
    ]
