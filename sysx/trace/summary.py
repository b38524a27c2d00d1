"""A measured window in four numbers, beside the plan of the same schedule.

Per recorded step, over every rank: the step runs from its first op's start to the last end on any
lane. ``iteration_s`` is the mean of that over the window; ``bubble`` is ``1 - busy / iteration``
with busy = the rank's FORWARD/BACKWARD time (the simulator's definition), averaged over ranks and
steps; ``optimizer_exposed_s`` is the time from the end of the step's last pass (the latest over
ranks) to the end of the step: optimizer and validation work that no compute hides; ``h2d_gbps``
is the bytes loaded host->device over the time the h2d lanes were busy.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import mean

from sysx.schedule.simulate import Timeline
from sysx.trace.recorder import COMPUTE, H2D, Span
from sysx.trace.timeline import PASSES, step_bounds, steps_of


def measured(spans: Sequence[Span], n_ranks: int) -> dict[str, float]:
    """``iteration_s``, ``bubble``, ``optimizer_exposed_s``, ``h2d_gbps`` of a merged window of ``n_ranks`` ranks."""
    steps = steps_of(spans)
    if not steps:
        raise ValueError("no span was recorded: nothing to summarise")
    R = n_ranks
    iterations, bubbles, exposed = [], [], []
    for step in steps:
        lo, hi = step_bounds(spans, step)
        it = hi - lo
        passes = [s for s in spans if s.step == step and s.lane == COMPUTE and s.op is not None and s.op.kind in PASSES]
        busy = [0.0] * R
        for s in passes:
            busy[s.rank] += s.end - s.start
        iterations.append(it)
        bubbles.append(mean(1.0 - b / it for b in busy) if it > 0 else 0.0)
        exposed.append(hi - max((s.end for s in passes), default=lo))
    loads = [s for s in spans if s.lane == H2D]
    load_s = sum(s.end - s.start for s in loads)
    gbps = sum(s.nbytes for s in loads) / load_s / 1e9 if load_s > 0 else 0.0
    return {
        "iteration_s": mean(iterations),
        "bubble": mean(bubbles),
        "optimizer_exposed_s": mean(exposed),
        "h2d_gbps": gbps,
    }


def planned(plan: Timeline) -> dict[str, float]:
    """``iteration_s`` and ``bubble`` of a simulated plan (in seconds)."""
    return {"iteration_s": plan.iteration, "bubble": plan.bubble_ratio}


def format_line(steps: Sequence[int], meas: dict[str, float], plan: dict[str, float] | None, source: str) -> str:
    """``timeline: steps 3-5 measured 0.412 s/step, bubble 31.0%, ... | plan (...) 0.398 s/step (measured/plan 1.04)``;
    ``plan`` may lack the bubble, or be None."""
    window = f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else f"{steps[0]}"
    line = (
        f"timeline: steps {window} measured {meas['iteration_s']:.4g} s/step, bubble {100 * meas['bubble']:.1f}%, "
        f"optimizer exposed {meas['optimizer_exposed_s']:.3g} s, h2d {meas['h2d_gbps']:.3g} GB/s"
    )
    if not plan:
        return line
    ratio = meas["iteration_s"] / plan["iteration_s"] if plan["iteration_s"] > 0 else float("inf")
    bubble = f", bubble {100 * plan['bubble']:.1f}%" if "bubble" in plan else ""
    return line + f" | plan ({source}) {plan['iteration_s']:.4g} s/step{bubble} (measured/plan {ratio:.2f})"
