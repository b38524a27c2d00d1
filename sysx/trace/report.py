"""The end of a recorded window: the ranks' records go to rank 0, which writes into ``run_dir``

* ``timeline.json``: the Chrome trace (:mod:`sysx.trace.chrome`);
* ``timeline.png``: one panel per recorded step, drawn by :func:`sysx.schedule.draw.draw_compare`
  like ``sysx plan --png`` draws a plan;
* ``plan.png`` (pipelines): the plan of the same schedule, simulated with the window's profiled costs
  (:func:`sysx.trace.costs.measured_costs`) or with the costs the caller passes (an emulated
  device passes the table it models time with);

and returns the measured and planned numbers (:mod:`sysx.trace.summary`) with a one-line comparison.
:class:`PipelineWindow` does it for a pipeline rank and keeps what rank 0 measured.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from sysx.schedule.costs import CostTable
from sysx.schedule.draw import draw, draw_compare
from sysx.schedule.ops import Schedule
from sysx.schedule.simulate import simulate
from sysx.trace.chrome import write_chrome
from sysx.trace.costs import measured_costs
from sysx.trace.recorder import RankPart, Recorder, Span
from sysx.trace.replicas import replica_spread
from sysx.trace.summary import format_line, measured, planned
from sysx.trace.timeline import merge, step_timelines, steps_of

TIMELINE_JSON, TIMELINE_PNG, PLAN_PNG = "timeline.json", "timeline.png", "plan.png"


@dataclass
class WindowReport:
    """What rank 0 wrote and measured."""

    measured: dict[str, float]
    plan: dict[str, float]
    line: str
    costs: CostTable | None  # what the plan was simulated with (None: no simulated plan)
    spans: list[Span]
    files: list[Path] = field(default_factory=list)

    def summary(self) -> dict[str, dict[str, float]]:
        """The ``summary.json`` sections: ``{"measured": ..., "plan": ...}`` (no plan: no ``plan``)."""
        out = {"measured": dict(self.measured)}
        if self.plan:
            out["plan"] = dict(self.plan)
        return out


def gather_parts(part: RankPart, *, rank: int, world: int, group: dist.ProcessGroup | None) -> list[RankPart] | None:
    """Every rank's part on rank 0 (None on the others); collective over ``group`` when ``world > 1``."""
    if world == 1:
        return [part]
    parts: list[RankPart] | None = [part] * world if rank == 0 else None  # slots, overwritten by the gather
    dist.gather_object(part, parts, dst=0, group=group)
    return parts


def write_report(
    parts: Sequence[RankPart],
    schedule: Schedule,
    run_dir: str | Path,
    *,
    plan_costs: CostTable | None = None,
    param_bytes: float = 2.0,
    plan_schedule: Schedule | None = None,
    trace_parts: Sequence[RankPart] | None = None,
) -> WindowReport:
    """A pipeline's window: :func:`write_window`, and ``plan.png`` with the plan simulated from the
    window's profiled costs (or ``plan_costs``), compared in the line and the summary. The plan runs
    ``plan_schedule`` when given (the program the window's steps ran, e.g. validating first);
    ``timeline.json`` holds ``trace_parts`` when given (every replica's ranks, where ``parts`` are
    the first replica's)."""
    spans = merge(parts)
    costs = plan_costs if plan_costs is not None else measured_costs(spans, schedule, param_bytes=param_bytes)
    plan = simulate(plan_schedule or schedule, costs, memory=False)
    report = write_window(
        spans,
        run_dir,
        name=schedule.name,
        n_ranks=schedule.n_ranks,
        schedule=schedule,
        plan=planned(plan),
        plan_source="modelled costs" if plan_costs is not None else "measured costs",
        trace_spans=merge(trace_parts) if trace_parts is not None else None,
    )
    report.costs = costs
    report.files.append(draw(plan, Path(run_dir) / PLAN_PNG))
    report.line += f" | {Path(run_dir)}/{{{TIMELINE_JSON},{TIMELINE_PNG},{PLAN_PNG}}}"
    return report


def write_window(
    spans: Sequence[Span],
    run_dir: str | Path,
    *,
    name: str,
    n_ranks: int,
    schedule: Schedule | None = None,
    plan: dict[str, float] | None = None,
    plan_source: str = "",
    trace_spans: Sequence[Span] | None = None,
) -> WindowReport:
    """Write merged ``spans`` as ``timeline.json`` and ``timeline.png`` into ``run_dir`` and measure
    them; ``plan`` (``iteration_s``, optionally ``bubble``) is what they are compared with.
    ``trace_spans`` (a superset of ``spans``: every replica) go to ``timeline.json`` instead."""
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [
        write_chrome(spans if trace_spans is None else trace_spans, out / TIMELINE_JSON, title=name, n_ranks=n_ranks),
        draw_compare(step_timelines(spans, n_ranks=n_ranks, name=name, schedule=schedule), out / TIMELINE_PNG),
    ]
    meas = measured(spans, n_ranks)
    line = format_line(steps_of(spans), meas, plan, plan_source)
    return WindowReport(meas, dict(plan or {}), line, None, list(spans), files)


class PipelineWindow:
    """A pipeline rank's recorded window once written: rank 0 keeps its numbers (``summary.json``'s
    ``measured`` and ``plan``), the costs its plan was simulated with, and its measured iteration."""

    def __init__(self, recorder: Recorder | None, *, rank: int, world: int, group: dist.ProcessGroup | None) -> None:
        self.recorder, self.rank, self.world, self.group = recorder, rank, world, group
        self.sections: dict[str, dict[str, float]] = {}
        self.costs: CostTable | None = None  # the recorded window's own costs, once written

    @property
    def last_step(self) -> int | None:
        """The window's last step (None: nothing is recorded)."""
        return self.recorder.last if self.recorder is not None else None

    def iteration(self) -> tuple[list[int], float] | None:
        """Rank 0: the window's steps and measured seconds per iteration, once written (else None)."""
        measured = self.sections.get("measured")
        if not measured or self.recorder is None:
            return None
        return list(range(self.recorder.first, self.recorder.last + 1)), measured["iteration_s"]

    def write(
        self,
        units: Mapping[str, tuple[int, int]],
        schedule: Schedule,
        run_dir: str | Path,
        *,
        modelled: Callable[[RankPart], RankPart],
        plan_costs: CostTable | None,
        plan_schedule: Schedule,
        param_bytes: float,
    ) -> None:
        """Gather every rank's records on rank 0, which writes them into ``run_dir`` beside the plan
        of ``plan_schedule`` (the program the window's steps ran, e.g. validating first) with
        ``plan_costs`` (:func:`write_report`) and prints the comparison (collective: every rank calls
        it after the window's last step). ``units``: sub-stage names to keys; ``modelled``: the
        device's view of a part (:meth:`sysx.emulate.pacer.Pacer.modelled`)."""
        rec = self.recorder
        assert rec is not None
        parts = gather_parts(modelled(rec.part(units)), rank=self.rank, world=self.world, group=self.group)
        rec.clear()
        if parts is None:
            return
        report = write_report(
            parts[: schedule.n_ranks],  # replicas run the same schedule: the first replica's ranks show it
            schedule,
            run_dir,
            plan_costs=plan_costs,
            param_bytes=param_bytes,
            plan_schedule=plan_schedule,
            trace_parts=parts if len(parts) > schedule.n_ranks else None,
        )
        print(report.line, flush=True)
        self.sections = report.summary()
        spread = replica_spread(parts, schedule.n_ranks)
        if spread is not None:  # where the replicas' meeting at VALIDATE waits
            print(spread.line(), flush=True)
            self.sections["measured"].update(spread.summary())
        self.costs = report.costs
