"""The CPU-optimizer side of one rank: OFFLOAD_GRADS targets, OPTIM_STEP and VALIDATE.

One :class:`sysx.optim.StageOptimizer` per backward sub-stage this rank owns (its master weights:
the shared fp32 copy itself with ``precision=fp32``, a private fp32 copy otherwise, whose new
values are written into the shared 16-bit copy after every change), run by
:class:`sysx.optim.OptimizerThreads`. Host gradient buffers are page-locked on CUDA so the D2H
copy is asynchronous; with fp32 they are the optimizer's own fp32 gradient buffers (no extra copy).

* asynchronous (SysX, CFG3): ``OPTIM_STEP`` hands the sub-stage to a worker thread, which waits
  for the offload event, unscales, checks and steps at once; ``VALIDATE`` waits for the workers
  and runs :func:`sysx.optim.post_step_validate` (one all-reduce, rollback or clipping re-step).
  A step the :class:`~sysx.optim.speculate.SpeculationPolicy` does not let speculate
  (``optim.speculate``) only loads and checks on the workers; ``VALIDATE`` then decides and
  steps every sub-stage on the workers (validate first, still off the main thread's op list).
  Sub-stages placed on the device lane (``optim.placement``, :mod:`sysx.runtime.lanes`) are only
  checked on the workers and step after the decision on the device (:mod:`sysx.optim.device_lane`),
  beside the workers' steps and re-steps of the others. With ``optim.rollback=exact``, when the next
  step will speculate, the workers then refresh each CPU-lane sub-stage's spare set
  (:meth:`sysx.optim.OptimizerThreads.refresh_spares`), unwaited: it runs during the next forward;
* synchronous (baselines): ``VALIDATE`` loads and checks every offloaded sub-stage, all-reduces
  the overflow count and squared norms and decides (:func:`sysx.optim.validation.load_and_check`,
  the check part of :func:`sysx.optim.sync_step`); each ``OPTIM_STEP`` op then steps its own
  sub-stage (:func:`sysx.optim.validation.apply_checked`, the apply part).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sysx import device as dev
from sysx.emulate.pacer import Pacer
from sysx.memory.pinned import HostBuffers
from sysx.optim.cores import plan_cores
from sysx.optim.device_lane import DeviceLane
from sysx.optim.loss_scaler import LossScaler
from sysx.optim.speculate import SpeculationPolicy
from sysx.optim.stage import OptimSettings, StageOptimizer
from sysx.optim.threads import OptimizerThreads, Pace
from sysx.optim.validation import StepOutcome, apply_checked, check_reports, load_and_check, post_step_validate
from sysx.runtime.stage_params import StageParams


class RankOptimizer:
    """Optimizer state and per-step protocol of the sub-stages one rank owns."""

    def __init__(
        self,
        params: StageParams,
        settings: OptimSettings,
        scaler: LossScaler,
        *,
        group: dist.ProcessGroup | None,
        local_rank: int = 0,
        local_world_size: int = 1,
        pace: Pace | None = None,
    ) -> None:
        self.settings = settings
        self.scaler = scaler
        self.group = group
        self.dtype = params.dtype
        self.stages: dict[tuple[int, int], StageOptimizer] = {}
        self.host_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.buffers = HostBuffers(f"rank {params.rank} host gradients")  # the D2H copies land here
        try:
            for unit in params.owned():
                key = (unit.stage, unit.sub)
                fp32 = self.dtype == torch.float32
                grad32 = (
                    self.buffers.empty(unit.numel, torch.float32)
                    if fp32
                    else torch.empty(unit.numel, dtype=torch.float32)
                )
                target = None if fp32 else params.shared[key]
                self.stages[key] = StageOptimizer.from_settings(
                    unit.key, params.masters[key], settings, target=target, grad_buffer=grad32
                )
                self.host_grads[key] = grad32 if fp32 else self.buffers.empty(unit.numel, self.dtype)
            workers, threads = settings.workers, settings.threads_per_worker
            if workers is None or threads is None:
                plan = plan_cores(
                    n_stages=len(self.stages),
                    backend="torch" if settings.backend == "torch" else "deepspeed",
                    local_rank=local_rank,
                    local_world_size=local_world_size,
                    workers=workers,
                )
                workers, threads = plan.optimizer_workers, threads or plan.threads_per_worker
            self.threads = OptimizerThreads(
                list(self.stages.values()),
                workers=workers,
                threads_per_worker=threads,
                name=f"sysx-opt-r{params.rank}",
                pace=pace,
            )
        except BaseException:
            self.close()
            raise
        self.events: dict[tuple[int, int], dev.Event] = {}
        self.outcome: StepOutcome | None = None
        self.step_seconds = 0.0
        # every rank feeds its policy the same all-reduced outcome, so all decide alike
        self.policy = SpeculationPolicy(
            settings.speculate, settings.speculate_after, can_veto=settings.grad_clip > 0 or self.dtype == torch.float16
        )
        self.speculating = self.policy.speculate()
        # units placed on the device lane (optim.placement) -> their modelled (in, step, out) seconds
        self.on_device: dict[tuple[int, int], tuple[float, float, float]] = {}
        self.lane: DeviceLane | None = None
        self.pacer = Pacer()

    def use_device_lane(
        self, units: dict[tuple[int, int], tuple[float, float, float]], lane: DeviceLane, pacer: Pacer
    ) -> None:
        """Step ``units`` on ``lane`` after every validation (``pacer`` charges their modelled times)."""
        for unit in units:
            self._stage(unit)
        self.on_device, self.lane, self.pacer = dict(units), lane, pacer

    # -------------------------------------------------------------------------------- per step
    def begin(self) -> None:
        """Forget the previous step's offloads and decision."""
        self.events.clear()
        self.outcome = None
        self.step_seconds = 0.0
        self.speculating = self.policy.speculate()

    def offloaded(self, unit: tuple[int, int], event: dev.Event) -> None:
        """Record that ``unit``'s gradients are on their way to :attr:`host_grads`."""
        self.events[unit] = event

    def submit(self, unit: tuple[int, int], *, lr: float, scale: float) -> None:
        """Asynchronous OPTIM_STEP: a worker waits for the offload, checks and steps (only checks
        when this step does not speculate)."""
        stage = self._stage(unit)
        if self.speculating and unit not in self.on_device:
            self.threads.submit_step(stage.name, self.host_grads[unit], self.events.get(unit), scale=scale, lr=lr)
        else:
            self.threads.submit_load(stage.name, self.host_grads[unit], self.events.get(unit), scale=scale)

    def validate_async(self, *, lr: float) -> StepOutcome:
        """Wait for the workers, then SysX's post-step validation (rollback / clipping re-step), or,
        when the step did not speculate, the decision and then every sub-stage's step."""
        reports = self.threads.wait()
        clip = self.settings.grad_clip
        if self.speculating:
            outcome = post_step_validate(
                reports, self.threads, self.scaler, lr=lr, max_grad_norm=clip, group=self.group, wait=False
            )
        else:
            outcome = check_reports(reports, self.scaler, max_grad_norm=clip, group=self.group)
            device = {self.stages[u].name for u in self.on_device}
            for r in reports:
                if r.stage not in device:
                    self.threads.submit(
                        lambda stage: apply_checked(stage, outcome, lr),
                        r.stage,
                        "step",
                        paced=None if outcome.skipped else "step",
                    )
        self.outcome = outcome
        self._device_steps(outcome, lr)  # beside the CPU lane's (re-)steps on the workers
        self.threads.wait_stages()
        self.policy.record(clean=not outcome.overflow and outcome.clip_coef == 1.0)
        if self.policy.speculate():  # the next step steps rollback=exact's spare: refresh it during the next forward
            self.threads.refresh_spares([s.name for u, s in self.stages.items() if u not in self.on_device])
        return outcome

    def _device_steps(self, outcome: StepOutcome, lr: float) -> None:
        """Step the device lane's units as ``outcome`` decided (clipped; nothing when skipped)."""
        if outcome.skipped or not self.on_device:
            return
        assert self.lane is not None
        for unit, seconds in self.on_device.items():
            stage = self.stages[unit]
            stage.scale_grads(outcome.clip_coef)
            self.pacer.device_optimizer(stage.name, seconds)
            stage.apply_on(self.lane, lr)
        self.pacer.device_optimizer_wait()

    def validate_sync(self, *, scale: float) -> StepOutcome:
        """Validate first (baselines): load and check every offloaded sub-stage, reduce, decide."""
        names = {self.stages[u].name: u for u in self.events}
        self.outcome = load_and_check(
            {n: self.host_grads[u] for n, u in names.items()},
            self.threads,
            self.scaler,
            max_grad_norm=self.settings.grad_clip,
            group=self.group,
            events={n: self.events[u] for n, u in names.items()},
            scale=scale,
        )
        return self.outcome

    def step_sync(self, unit: tuple[int, int], *, lr: float) -> None:
        """Synchronous OPTIM_STEP after :meth:`validate_sync`: clip and step ``unit`` (unless skipped)."""
        if self.outcome is None:
            raise RuntimeError(f"OPTIM_STEP s{unit[0]}.{unit[1]}: a synchronous step needs VALIDATE first")
        apply_checked(self._stage(unit), self.outcome, lr)

    def _stage(self, unit: tuple[int, int]) -> StageOptimizer:
        try:
            return self.stages[unit]
        except KeyError:
            raise RuntimeError(
                f"sub-stage s{unit[0]}.{unit[1]} is not owned by this rank (owned: "
                f"{sorted(self.stages)}); its optimizer lives on the rank running its backward"
            ) from None

    # ------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Join the worker threads and release the optimizers (their views of shared memory too)."""
        threads, self.threads = getattr(self, "threads", None), None
        if threads is not None:
            threads.close()
        lane, self.lane = getattr(self, "lane", None), None
        if lane is not None:
            lane.close()
        for stage in self.stages.values():
            stage.close()
        self.stages.clear()
        self.host_grads.clear()
        self.events = {}
        self.buffers.close()
