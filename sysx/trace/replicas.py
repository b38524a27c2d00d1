"""How far apart a job's data-parallel replicas finish a step's passes, from a recorded window.

The replicas meet once a step, where their gradients are reduced (VALIDATE), so every replica waits
there for the last one to finish its passes. On the idle 16-core host of the second H200 lease a
job of 4 replicas spent 47-79 ms a step in VALIDATE where its plan had 15 ms (issue 27, point 3):
only rank 0 was drawn, which showed the wait and not who it waited for. Every rank records its
window anyway, so rank 0 measures here, per recorded step, when each replica's last pass ended
(the latest over the replica's ranks, on the one clock of a node) and how far the first and the
last replica were apart. Ranks on several hosts have no common clock: no figure then.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

from sysx.trace.recorder import COMPUTE, RankPart
from sysx.trace.timeline import PASSES, merge, steps_of


@dataclass(frozen=True)
class ReplicaSpread:
    """Per recorded step, the seconds between the first and the last replica's end of its passes."""

    steps: list[int]
    spreads: list[float]
    last: list[int]  # per step, the replica that finished its passes last

    def summary(self) -> dict[str, float]:
        """The ``summary.json`` figures: the median and the largest spread over the window."""
        return {"replica_spread_s": median(self.spreads), "replica_spread_max_s": max(self.spreads)}

    def line(self) -> str:
        """``replicas: the last finished its passes 12.3 ms after the first (median of 5 steps, max
        36.1 ms); last: replica 2 in 3 steps, replica 0 in 2``."""
        counts = Counter(self.last).most_common()
        who = ", ".join(f"replica {r} in {n} step{'s' if n > 1 else ''}" for r, n in counts)
        return (
            f"replicas: the last finished its passes {1e3 * median(self.spreads):.1f} ms after the first (median of "
            f"{len(self.spreads)} steps, max {1e3 * max(self.spreads):.1f} ms); last: {who}"
        )


def replica_spread(parts: Sequence[RankPart], ranks_per_replica: int) -> ReplicaSpread | None:
    """The spread of a window's replicas (``parts``: every rank's, in global rank order; replica r
    holds ranks ``r * ranks_per_replica ...``); None for one replica, ranks on several hosts, or no
    step in which every replica ran a pass."""
    if len(parts) <= ranks_per_replica or len({p.host for p in parts}) > 1:
        return None
    spans = merge(parts)
    steps, spreads, last = [], [], []
    for step in steps_of(spans):
        ends: dict[int, float] = {}
        for s in spans:
            if s.step == step and s.lane == COMPUTE and s.op is not None and s.op.kind in PASSES:
                replica = s.rank // ranks_per_replica
                ends[replica] = max(ends.get(replica, s.end), s.end)
        if len(ends) * ranks_per_replica < len(parts):
            continue
        steps.append(step)
        spreads.append(max(ends.values()) - min(ends.values()))
        last.append(max(ends, key=lambda r: ends[r]))
    return ReplicaSpread(steps, spreads, last) if steps else None
