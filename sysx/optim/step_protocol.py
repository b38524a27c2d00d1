"""One optimizer step's protocol after the backward, shared by the pipeline's ranks and the window.

:class:`StepProtocol` holds the decision both trainers take for every step and what follows it:
whether the step speculates (:class:`~sysx.optim.speculate.SpeculationPolicy`), so each stage's
job steps at once or only loads and checks (:meth:`StepProtocol.submit`); the validation
(:meth:`StepProtocol.decide`: post-step rollback and clipping re-steps, or validate first and then
the steps, queued on the workers in the reports' order); the device lane's steps on the calling
thread in their given order (``optim.placement``, :mod:`sysx.optim.device_lane`); and, once the
outcome is recorded, the ``optim.rollback=exact`` spare refresh when the next step speculates
(:meth:`StepProtocol.record`). The callers keep what differs: when they wait for the queued jobs
(the pipeline at VALIDATE, the window per block before the next forward needs it) and in which
order the reports come.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from sysx.device import Event
from sysx.optim.grad_norm import NormSlots
from sysx.optim.loss_scaler import LossScaler
from sysx.optim.speculate import SpeculationPolicy
from sysx.optim.stage import OptimSettings, StageReport
from sysx.optim.threads import OptimizerThreads
from sysx.optim.validation import StepOutcome, apply_checked, check_reports, post_step_validate
from sysx.trace.recorder import COMPUTE

if TYPE_CHECKING:
    import torch

    from sysx.optim.device_lane import DeviceLane

LaneSeconds = tuple[float, float, float]  # a device-lane step's modelled copy in, step and copy out
UNTIMED: LaneSeconds = (0.0, 0.0, 0.0)


class LanePacer(Protocol):
    """What charges device-lane steps their modelled times (:class:`sysx.emulate.pacer.Pacer`)."""

    def device_optimizer(self, name: str, seconds: LaneSeconds) -> None: ...

    def device_optimizer_wait(self) -> None: ...


class StepProtocol:
    """Speculate or validate first, the device lane and the spare refresh of ``threads``' stages.

    ``settings`` give the clipping threshold and the speculation mode; ``fp16``: the loss scaler can
    veto a step. ``group`` (the pipeline's ranks) or ``total_norm`` (the window's global norm in its
    reference's order), and ``norm_pieces``, as for :func:`~sysx.optim.validation.post_step_validate`."""

    def __init__(
        self,
        threads: OptimizerThreads,
        scaler: LossScaler,
        settings: OptimSettings,
        *,
        fp16: bool,
        group: dist.ProcessGroup | None = None,
        total_norm: Callable[[], float] | None = None,
        norm_pieces: int | NormSlots = 0,
    ) -> None:
        self.threads = threads
        self.norm_pieces = norm_pieces
        self.scaler = scaler
        self.max_grad_norm = settings.grad_clip
        self.group = group
        self.total_norm = total_norm
        # every rank of a pipeline feeds its policy the same all-reduced outcome, so all decide alike
        self.policy = SpeculationPolicy(
            settings.speculate, settings.speculate_after, can_veto=settings.grad_clip > 0 or fp16
        )
        self.speculating = self.policy.speculate()
        self.on_device: dict[str, LaneSeconds] = {}  # stages the device lane steps, in its order
        self.lane: DeviceLane | None = None
        self.pacer: LanePacer | None = None

    def use_device_lane(
        self, units: Mapping[str, LaneSeconds], lane: DeviceLane, pacer: LanePacer | None = None
    ) -> None:
        """Step the stages named in ``units`` on ``lane``, in that order, after every decision
        (``pacer`` charges each its modelled seconds); a previous lane is closed."""
        for name in units:
            self.threads.stage(name)  # a KeyError naming the stages
        if self.lane is not None and self.lane is not lane:
            self.lane.close()
        self.on_device, self.lane, self.pacer = dict(units), lane, pacer

    def begin(self) -> bool:
        """Whether the step starting now speculates (its jobs step before the validation)."""
        self.speculating = self.policy.speculate()
        return self.speculating

    def submit(self, name: str, grads: torch.Tensor, event: Event | None, *, scale: float, lr: float) -> None:
        """Hand stage ``name``'s gradients to a worker: it waits for ``event``, loads and checks,
        and steps too when this step speculates and the stage is not on the device lane."""
        if self.speculating and name not in self.on_device:
            self.threads.submit_step(name, grads, event, scale=scale, lr=lr)
        else:
            self.threads.submit_load(name, grads, event, scale=scale)

    def decide(self, reports: Sequence[StageReport], lr: float) -> StepOutcome:
        """Validate this step from the workers' ``reports``: speculated, the post-step validation
        (rollbacks and clipping re-steps queued); else the decision and every CPU-lane stage's step
        queued, in the reports' order. Then the device lane's steps, on this thread."""
        if self.speculating:
            outcome = post_step_validate(
                reports,
                self.threads,
                self.scaler,
                lr=lr,
                max_grad_norm=self.max_grad_norm,
                group=self.group,
                total_norm=self.total_norm,
                wait=False,
                norm_pieces=self.norm_pieces,
            )
        else:
            outcome = check_reports(
                reports,
                self.scaler,
                max_grad_norm=self.max_grad_norm,
                group=self.group,
                total_norm=self.total_norm,
                norm_pieces=self.norm_pieces,
            )
            if not outcome.skipped:
                for r in reports:
                    if r.stage not in self.on_device:
                        self.threads.submit(
                            lambda stage: apply_checked(stage, outcome, lr), r.stage, "step", paced="step"
                        )
        self.device_steps(outcome, lr)
        return outcome

    def device_steps(self, outcome: StepOutcome, lr: float) -> None:
        """Step the device lane's stages as ``outcome`` decided (clipped; nothing when skipped)."""
        if outcome.skipped or not self.on_device:
            return
        assert self.lane is not None
        rec = self.threads.recorder
        rec = rec if rec is not None and rec.on else None
        for name, seconds in self.on_device.items():
            stage = self.threads.stage(name)
            stage.scale_grads(outcome.clip_coef)
            if self.pacer is not None:
                self.pacer.device_optimizer(name, seconds)
            begin = rec.now() if rec is not None else 0.0
            stage.apply_on(self.lane, lr)
            if rec is not None:  # on the device's row: its copies and kernels hold the device till it returns
                rec.add(COMPUTE, ("device", name), begin, rec.now())
        if self.pacer is not None:
            self.pacer.device_optimizer_wait()

    def record(self, outcome: StepOutcome) -> bool:
        """Feed the policy ``outcome``; when the next step speculates, queue the CPU lane's
        ``rollback=exact`` spare refresh behind the decided jobs (it runs into the next forward).
        Returns whether the step was clean (not vetoed)."""
        clean = not outcome.overflow and outcome.clip_coef == 1.0
        self.policy.record(clean=clean)
        if self.policy.speculate():
            self.threads.refresh_spares([n for n in self.threads.stages if n not in self.on_device])
        return clean

    def close(self) -> None:
        """Free the device lane's buffers."""
        lane, self.lane = self.lane, None
        if lane is not None:
            lane.close()
