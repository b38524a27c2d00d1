"""What a pipeline rank measures about its own run, beside the run: the profile window (NVTX, the
Nsight Systems range, the recorded timeline, :mod:`sysx.trace.window`), the recorded window written
beside its plan (:class:`sysx.trace.report.PipelineWindow`), the prediction check
(:mod:`sysx.trainers.prediction`), and the ``summary.json`` sections they give."""

from __future__ import annotations

from typing import Any

from sysx.config import SysxConfig
from sysx.emulate.device_model import DeviceModel
from sysx.metrics import StepResult
from sysx.runtime.rank import RankRuntime
from sysx.schedule.costs import Costs
from sysx.trace.report import PipelineWindow
from sysx.trace.window import StepWindow
from sysx.trainers.prediction import RunCosts, RunPrediction, cached_profile


class PipelineObservation:
    """The measurements of ``rank``'s run (see the module doc). ``tuned``: what ``schedule.tune``
    predicted the run with (rank 0); ``rss0``: the host RSS before the training state existed."""

    def __init__(
        self,
        cfg: SysxConfig,
        rank: RankRuntime,
        model: DeviceModel,
        *,
        tuned: Costs | None,
        rss0: int,
    ) -> None:
        self.cfg, self.rank, self.model = cfg, rank, model
        self.window = StepWindow(cfg.profile, rank.device, rank.rank, compute=rank.compute, announce=rank.rank == 0)
        if self.window.recorder is not None:
            rank.record(self.window.recorder)
        self.timeline = PipelineWindow(self.window.recorder, rank=rank.rank, world=rank.world, group=rank.group)
        lookup = cached_profile(cfg, rank.world, rank.local_world_size, rank.device, rank.optimizer.threads)
        self.costs = RunCosts(tuned, model.table_for, lookup=lookup, window=self.timeline)
        self.prediction = RunPrediction(
            self.costs,
            model,
            self.timeline,
            rank.all_reduce,
            rank=rank.rank,
            total_steps=cfg.train.steps,
            device=rank.device,
            local_world_size=rank.local_world_size,
            rss0=rss0,
        )

    def after_step(self, result: StepResult) -> None:
        """Step ``result.step`` is over on every rank: write the recorded window after its last step,
        then the prediction check (both collective: every rank calls this after every step)."""
        if self.window.after(result.step):
            self.write_timeline()
        self.prediction.after_step(result)

    def write_timeline(self) -> None:
        """The recorded window to rank 0, which writes it into ``run_dir`` beside the plan and prints
        the comparison (collective: every rank calls it after the window's last step)."""
        rank, recorder = self.rank, self.window.recorder
        assert recorder is not None
        program = self.model.plan_schedule(range(recorder.first, recorder.last + 1))  # validating first, or not
        self.timeline.write(
            {stage.name: key for key, stage in rank.optimizer.stages.items()},
            rank.schedule,
            self.cfg.run_dir,
            modelled=self.model.pacer.modelled,
            plan_costs=self.costs.plan_table(program),
            plan_schedule=program,
            param_bytes=float(rank.dtype.itemsize),
        )
        # the others wait here for rank 0's files, not inside the next step (which would time the drawing)
        rank.all_reduce([0.0], "recorded window written")

    def sections(self) -> dict[str, Any]:
        """``{"measured": ..., "plan": ...}`` of the recorded window on rank 0, once written, and the
        ``prediction`` once checked."""
        out: dict[str, Any] = dict(self.timeline.sections)
        if self.prediction.section:
            out["prediction"] = self.prediction.section
        return out
