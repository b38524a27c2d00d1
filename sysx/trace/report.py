"""The end of a recorded window: the ranks' records go to rank 0, which writes into ``run_dir``

* ``timeline.json``: the Chrome trace (:mod:`sysx.trace.chrome`);
* ``timeline.png``: one panel per recorded step, drawn by :func:`sysx.schedule.draw.draw_compare`
  like ``sysx plan --png`` draws a plan;
* ``plan.png``: the plan of the same schedule, simulated with the window's profiled costs
  (:func:`sysx.trace.costs.measured_costs`) or with the costs the caller passes (an emulated
  device passes the table it models time with);

and returns the measured and planned numbers (:mod:`sysx.trace.summary`) with a one-line comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from sysx.schedule.costs import CostTable
from sysx.schedule.draw import draw, draw_compare
from sysx.schedule.ops import Schedule
from sysx.schedule.simulate import simulate
from sysx.trace.chrome import write_chrome
from sysx.trace.costs import measured_costs
from sysx.trace.recorder import RankPart, Span
from sysx.trace.summary import format_line, measured, planned
from sysx.trace.timeline import merge, step_timelines, steps_of

TIMELINE_JSON, TIMELINE_PNG, PLAN_PNG = "timeline.json", "timeline.png", "plan.png"


@dataclass
class WindowReport:
    """What rank 0 wrote and measured."""

    measured: dict[str, float]
    plan: dict[str, float]
    line: str
    costs: CostTable
    spans: list[Span]
    files: list[Path] = field(default_factory=list)

    def summary(self) -> dict[str, dict[str, float]]:
        """The ``summary.json`` sections: ``{"measured": ..., "plan": ...}``."""
        return {"measured": dict(self.measured), "plan": dict(self.plan)}


def gather_parts(part: RankPart, *, rank: int, world: int, group: dist.ProcessGroup | None) -> list[RankPart] | None:
    """Every rank's part on rank 0 (None on the others); collective over ``group`` when ``world > 1``."""
    if world == 1:
        return [part]
    parts: list[RankPart] | None = [part] * world if rank == 0 else None  # slots, overwritten by the gather
    dist.gather_object(part, parts, dst=0, group=group)
    return parts


def write_report(parts: Sequence[RankPart], schedule: Schedule, run_dir: str | Path, *,
                 plan_costs: CostTable | None = None, param_bytes: float = 2.0) -> WindowReport:
    """Merge ``parts``, write the three files into ``run_dir`` and compare with the plan (see the
    module doc); ``plan_costs`` replaces the profiled costs of the plan."""
    spans = merge(parts)
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    costs = plan_costs if plan_costs is not None else measured_costs(spans, schedule, param_bytes=param_bytes)
    plan = simulate(schedule, costs, memory=False)
    files = [write_chrome(spans, out / TIMELINE_JSON, title=schedule.name, n_ranks=schedule.n_ranks),
             draw_compare(step_timelines(spans, schedule), out / TIMELINE_PNG),
             draw(plan, out / PLAN_PNG)]
    meas, plan_numbers = measured(spans, schedule), planned(plan)
    source = "modelled costs" if plan_costs is not None else "measured costs"
    line = format_line(steps_of(spans), meas, plan_numbers, source) + f" | {out}/{{{TIMELINE_JSON},{TIMELINE_PNG},{PLAN_PNG}}}"
    return WindowReport(meas, plan_numbers, line, costs, spans, files)
