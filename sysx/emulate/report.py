"""Bookkeeping of an emulated run: per step and rank, the wall time, the GPU-busy time, how late
the real work made the modelled timeline, and the ratio real part / modelled duration of every
paced op; merged over the ranks into the run's ``emulation`` report (``summary.json``).

The measurement is refused (``measured`` is None, ``refused`` says why with the ratios) when real
work made a rank lag its modelled timeline by more than ``max_late`` of a measured step, or when
the real part of the ops of a kind is longer than their modelled time on average: then the time
says more about this machine than about the emulated cluster (raise ``emulate.time_scale``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KINDS = ("compute", "h2d", "d2h", "p2p", "optimizer", "reduce")  # reduce: the replicas' reductions and exchange


@dataclass
class Ratios:
    """Real part / modelled duration of the ops of one kind. For messages (``p2p``) the value is
    instead how far past its modelled end the host left the message, in wall seconds: gloo does
    not say when data arrived before it is waited for, and a delivery hidden behind other work
    delays nothing."""

    n: int = 0
    total: float = 0.0
    over: int = 0
    worst: float = 0.0
    worst_op: str = ""

    def add(self, ratio: float, label: str, *, over: float = 1.0) -> None:
        """One op (``over``: the value above which it counts as over its model)."""
        self.n += 1
        self.total += ratio
        self.over += ratio > over
        if ratio > self.worst:
            self.worst, self.worst_op = ratio, label

    def merge(self, other: Ratios) -> None:
        """Fold ``other`` in."""
        self.n += other.n
        self.total += other.total
        self.over += other.over
        if other.worst > self.worst:
            self.worst, self.worst_op = other.worst, other.worst_op

    @property
    def mean(self) -> float:
        """Mean ratio (0 with no op)."""
        return self.total / self.n if self.n else 0.0


@dataclass
class StepStats:
    """One step of one rank (times in wall seconds)."""

    step: int
    wall: float = 0.0
    busy: float = 0.0  # modelled GPU compute of the step
    late: float = 0.0  # the largest lag of the host behind its modelled cursor
    late_op: str = ""  # where it was seen
    ratios: dict[str, Ratios] = field(default_factory=lambda: {k: Ratios() for k in KINDS})
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)  # (lane, op, modelled start, end)


def merge_report(
    per_rank: list[list[StepStats]],
    *,
    time_scale: float,
    warmup_steps: int,
    max_late: float,
    plan_iteration: float,
    plan_bubble: float,
) -> dict[str, Any]:
    """The ``emulation`` report of a run from every rank's steps (times in modelled seconds)."""
    steps = sorted({s.step for stats in per_rank for s in stats})
    measured = steps[warmup_steps:]
    out: dict[str, Any] = {
        "time_scale": time_scale,
        "steps_measured": len(measured),
        "plan": {"iteration_s": plan_iteration, "bubble": plan_bubble},
        "measured": None,
        "late_fraction": None,
        "real_ratio": {},
        "p2p_past_model": None,
        "refused": None,
    }
    if not measured:
        out["refused"] = f"no step after the {warmup_steps} warm-up step(s) (emulate.warmup_steps)"
        return out
    rows = [[s for s in stats if s.step in measured] for stats in per_rank]
    walls = [max(s.wall for rank in rows for s in rank if s.step == step) for step in measured]
    iteration = sum(walls) / len(walls)
    busy = [sum(s.busy for s in rank) / len(measured) for rank in rows]
    lagged = max((s for rank in rows for s in rank), key=lambda s: s.late / s.wall if s.wall > 0 else 0.0)
    late = lagged.late / lagged.wall if lagged.wall > 0 else 0.0
    ratios = {k: Ratios() for k in KINDS}
    for rank in rows:
        for s in rank:
            for k in KINDS:
                ratios[k].merge(s.ratios[k])
    out["late_fraction"] = late
    out["late_op"] = lagged.late_op
    out["real_ratio"] = {
        k: {"ops": r.n, "mean": r.mean, "max": r.worst, "over_1": r.over, "worst_op": r.worst_op}
        for k, r in ratios.items()
        if r.n and k != "p2p"
    }
    p2p = ratios["p2p"]
    out["p2p_past_model"] = {
        "messages": p2p.n,
        "late": p2p.over,
        "max_s": p2p.worst / time_scale,
        "worst": p2p.worst_op,
    }
    slow = [k for k, r in ratios.items() if k != "p2p" and r.n and r.mean > 1.0]  # messages: their lag counts
    if slow or late > max_late:
        worst = max((r for k, r in ratios.items() if k != "p2p"), key=lambda r: r.worst)
        if slow:
            why = (
                f"the real part of {', '.join(slow)} ops is longer than modelled (mean ratio "
                + ", ".join(f"{ratios[k].mean:.2f}" for k in slow)
                + ")"
            )
        else:
            why = (
                f"real work made a rank lag its modelled timeline by {100 * late:.1f}% of a step at "
                f"{lagged.late_op} (emulate.max_late={max_late:g})"
            )
        out["refused"] = (
            f"{why}; worst op {worst.worst_op} at {worst.worst:.2f}x its modelled time; "
            f"raise emulate.time_scale (now {time_scale:g}) or run on a less busy machine"
        )
        return out
    it = iteration / time_scale
    out["measured"] = {
        "iteration_s": it,
        "bubble": 1.0 - sum(busy) / (iteration * len(busy)),
        "over_plan": it / plan_iteration if plan_iteration > 0 else None,
    }
    return out


def span_seconds(per_rank: list[list[StepStats]], steps: list[int], prefix: str, time_scale: float) -> float:
    """Modelled seconds per step of the spans named ``prefix...`` (e.g. the replicas' ``RED`` and
    ``GATHER``), the busiest rank's mean over ``steps`` (0 with none)."""
    best = 0.0
    for stats in per_rank:
        rows = [s for s in stats if s.step in steps]
        total = sum(end - start for s in rows for _, name, start, end in s.spans if name.startswith(prefix))
        best = max(best, total / len(rows) / time_scale if rows else 0.0)
    return best


def describe(report: dict[str, Any]) -> str:
    """One line for the log."""
    plan = report["plan"]
    head = f"emulation (time x{report['time_scale']:g}): plan {plan['iteration_s']:.3f} s/iteration, bubble {100 * plan['bubble']:.1f}%"
    if report["measured"] is None:
        return f"{head}; measurement REFUSED: {report['refused']}"
    m = report["measured"]
    ratios = ", ".join(f"{k} {v['max']:.2f}" for k, v in report["real_ratio"].items())
    p2p = report["p2p_past_model"]
    return (
        f"{head}; measured {m['iteration_s']:.3f} s ({m['over_plan']:.3f}x plan), bubble {100 * m['bubble']:.1f}%, "
        f"{report['steps_measured']} step(s), largest lag {100 * report['late_fraction']:.2f}% of a step; worst "
        f"real/modelled: {ratios}; {p2p['late']} of {p2p['messages']} messages ended over 1 ms (wall) past their "
        f"modelled time (the worst by {1000 * p2p['max_s']:.1f} ms modelled)"
    )
