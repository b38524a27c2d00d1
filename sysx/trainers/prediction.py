"""A pipeline run checks its prediction after its first steps (:mod:`sysx.autotune.check`).

Every rank calls :meth:`RunPrediction.after_step` after each step; at the check step (the same on
every rank) the ranks reduce their memory peaks, and rank 0 simulates the schedule with the costs
the run used, compares, prints the line (and the warning) and keeps the ``prediction`` section
for ``summary.json``. The measured iteration is the recorded window's when the timeline recorder
ran, else the mean of the logged step times after the warm-up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from sysx import device as dev
from sysx.autotune.check import GPU, HOST, Prediction, check_step, compare, measured_window, predict
from sysx.metrics import StepResult
from sysx.schedule.costs import Costs, CostTable


class RunPrediction:
    """The check of one rank's trainer (built once the trainer is, before its first step).

    ``trainer`` is a :class:`sysx.trainers.pipeline.PipelineTrainer` (not imported: it imports this)."""

    def __init__(self, trainer: Any, tuned: Costs | None, *, rss0: int) -> None:
        self.trainer = trainer
        self.tuned = tuned
        self.emulated = trainer.cfg.device == "emulated"
        self.rss0 = rss0  # the RSS before the trainer built its state: the growth is what the plan describes
        self.step_times: list[tuple[int, float]] = []
        self.at: int | None = None  # set at the first step this process runs (after a resume, too)
        self.section: dict[str, Any] = {}

    def _memory_kind(self) -> str:
        if self.emulated:  # the emulated GPU's memory is modelled, its stand-in holds tiny tensors
            return ""
        return GPU if dev.is_cuda(self.trainer.device) else HOST

    def _peak(self) -> float | None:
        """Collective: the fullest rank's GPU peak, or every rank's host growth summed (CPU)."""
        t = self.trainer
        kind = self._memory_kind()
        if not kind:
            return None
        mine = (
            float(dev.max_memory_allocated(t.device)) if kind == GPU else float(dev.host_peak_rss_bytes() - self.rss0)
        )
        # through the trainer's sliced wait: a signal or a dead peer during the check stops it
        (value,) = t._all_reduce(
            [mine], "prediction check (memory peaks)", op=dist.ReduceOp.MAX if kind == GPU else dist.ReduceOp.SUM
        )
        return float(value)

    def costs(self) -> tuple[Costs | CostTable | None, str]:
        """Rank 0: the costs the run used and their name (see :mod:`sysx.autotune.check`)."""
        t = self.trainer
        if self.tuned is not None:
            return self.tuned, "tuned profile"
        plan = t.plan_costs()
        if plan is not None:
            return plan, "emulated device"
        from sysx.autotune.apply import cached_costs

        assert t.optimizer is not None
        threads = t.optimizer.threads
        cached = cached_costs(
            t.cfg,
            t.world,
            t.info.local_world_size,
            t.device,
            workers=threads.workers,
            threads=threads.threads_per_worker or 1,
        )
        if cached is not None:
            return cached, "cached profile"
        window = t.window_costs
        return (window, "recorded window's costs") if window is not None else (None, "")

    def after_step(self, result: StepResult) -> None:
        """Note the step's time; at the check step, compare (collective at that step)."""
        self.step_times.append((result.step, result.step_time_s))
        if self.at is None:
            rec = self.trainer.window.recorder
            self.at = check_step(result.step, self.trainer.cfg.train.steps, rec.last if rec is not None else None)
        if result.step != self.at:
            return
        t = self.trainer
        peak = self._peak()
        if t.rank != 0:
            return
        costs, source = self.costs()
        if costs is None:
            print(
                "prediction: none (no profile of this machine and model shape is cached; schedule.tune=true or "
                "`sysx tune` measures one)",
                flush=True,
            )
            return
        recorded = t.recorded_iteration()
        if recorded is not None:
            rec = t.window.recorder
            steps, iteration, how = list(range(rec.first, rec.last + 1)), recorded, "timeline"
        else:
            steps, iteration = measured_window(self.step_times)
            how = "step times"
        gpn = t.pacer.plan.cluster.gpus_per_node if self.emulated else t.info.local_world_size
        schedule = t.plan_schedule(steps)  # validating first after a clipped step runs another program
        if schedule is not t.schedule:
            source = f"{source}, validating first"
        pred: Prediction = predict(schedule, costs, memory=self._memory_kind(), source=source, gpus_per_node=gpn)
        if self.emulated and self.tuned is None and t.lane_plan is not None and schedule is t.schedule:
            pred = dataclasses.replace(pred, iteration_s=t.lane_plan[0], source=f"{source}, device lane included")
        self.section, lines = compare(pred, iteration, peak, steps=steps, measured_by=how)
        for line in lines:
            print(line, flush=True)


class SinglePrediction:
    """``schedule=single``: the planner's predicted step time and memory (its :class:`SinglePlan`)
    against the run's, after the same first steps (one process: nothing collective)."""

    def __init__(self, plan: Any, device: torch.device) -> None:
        self.plan, self.device = plan, device
        self.rss0 = dev.host_rss_bytes()
        self.step_times: list[tuple[int, float]] = []
        self.at: int | None = None
        self.section: dict[str, Any] = {}

    def after_step(self, result: StepResult, total_steps: int, recorded: tuple[int, int, float] | None) -> None:
        """Note the step; at the check step compare. ``recorded``: ``(first, last, seconds)`` of a
        written timeline window, else None."""
        self.step_times.append((result.step, result.step_time_s))
        if self.at is None:
            self.at = check_step(result.step, total_steps, None)
        if result.step != self.at:
            return
        cuda = dev.is_cuda(self.device)
        dev_total = float(self.plan.device_bytes["total"])
        # on CPU the planner's device buffers are host memory too
        peak_plan = dev_total if cuda else dev_total + float(self.plan.host_bytes["total"])
        peak = float(dev.max_memory_allocated(self.device)) if cuda else float(dev.host_peak_rss_bytes() - self.rss0)
        pred = Prediction(self.plan.times["step_s"], peak_plan, GPU if cuda else HOST, "single-device planner")
        if recorded is not None:
            steps, iteration, how = list(range(recorded[0], recorded[1] + 1)), recorded[2], "timeline"
        else:
            (steps, iteration), how = measured_window(self.step_times), "step times"
        self.section, lines = compare(pred, iteration, peak, steps=steps, measured_by=how)
        for line in lines:
            print(line, flush=True)
