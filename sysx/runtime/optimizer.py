"""The CPU-optimizer side of one rank: OFFLOAD_GRADS targets, OPTIM_STEP and VALIDATE.

One :class:`sysx.optim.StageOptimizer` per backward sub-stage this rank owns (its master weights:
the shared fp32 copy itself with ``precision=fp32``, a private fp32 copy otherwise, whose new
values are written into the shared 16-bit copy after every change), run by
:class:`sysx.optim.OptimizerThreads`. Host gradient buffers are page-locked on CUDA so the D2H
copy is asynchronous; with fp32 they are the optimizer's own fp32 gradient buffers (no extra copy).

* asynchronous (SysX, CFG3): ``OPTIM_STEP`` hands the sub-stage to a worker thread, which waits
  for the offload event, unscales, checks and steps at once; ``VALIDATE`` waits for the workers
  and runs :func:`sysx.optim.post_step_validate` (one all-reduce, rollback or clipping re-step);
* synchronous (baselines): ``VALIDATE`` loads and checks every offloaded sub-stage, all-reduces
  the overflow count and squared norms and decides (the validate-first order of
  :func:`sysx.optim.sync_step`, split so that each ``OPTIM_STEP`` op then steps its own sub-stage).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sysx import device as dev
from sysx.optim.cores import plan_cores
from sysx.optim.loss_scaler import LossScaler
from sysx.optim.stage import StageOptimizer
from sysx.optim.threads import OptimizerThreads
from sysx.optim.validation import StepOutcome, clip_coefficient, post_step_validate, reduce_flags
from sysx.runtime.stage_params import StageParams


@dataclass(frozen=True)
class OptimSettings:
    """Hyper-parameters and mechanics of the host optimizer."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_clip: float
    backend: str = "auto"
    rollback: str = "undo"
    workers: int | None = None
    threads_per_worker: int | None = None


class RankOptimizer:
    """Optimizer state and per-step protocol of the sub-stages one rank owns."""

    def __init__(self, params: StageParams, settings: OptimSettings, scaler: LossScaler, *,
                 group: dist.ProcessGroup | None, local_rank: int = 0, local_world_size: int = 1) -> None:
        self.settings = settings
        self.scaler = scaler
        self.group = group
        self.dtype = params.dtype
        self.stages: dict[tuple[int, int], StageOptimizer] = {}
        self.host_grads: dict[tuple[int, int], torch.Tensor] = {}
        pin = dev.cuda_available()
        try:
            for unit in params.owned():
                key = (unit.stage, unit.sub)
                grad32 = dev.empty_host(unit.numel, torch.float32, pin=pin and self.dtype == torch.float32)
                target = None if self.dtype == torch.float32 else params.shared[key]
                self.stages[key] = StageOptimizer(
                    unit.key, params.masters[key], lr=settings.lr, betas=settings.betas, eps=settings.eps,
                    weight_decay=settings.weight_decay, backend=settings.backend, rollback=settings.rollback,
                    target=target, grad_buffer=grad32)
                self.host_grads[key] = grad32 if self.dtype == torch.float32 else dev.empty_host(unit.numel, self.dtype, pin=pin)
            workers, threads = settings.workers, settings.threads_per_worker
            if workers is None or threads is None:
                plan = plan_cores(n_stages=len(self.stages), backend="torch" if settings.backend == "torch" else "deepspeed",
                                  local_rank=local_rank, local_world_size=local_world_size, workers=workers)
                workers, threads = plan.optimizer_workers, threads or plan.threads_per_worker
            self.threads = OptimizerThreads(list(self.stages.values()), workers=workers, threads_per_worker=threads,
                                            name=f"sysx-opt-r{params.rank}")
        except BaseException:
            self.close()
            raise
        self.events: dict[tuple[int, int], dev.Event] = {}
        self.outcome: StepOutcome | None = None
        self.step_seconds = 0.0

    # -------------------------------------------------------------------------------- per step
    def begin(self) -> None:
        """Forget the previous step's offloads and decision."""
        self.events.clear()
        self.outcome = None
        self.step_seconds = 0.0

    def offloaded(self, unit: tuple[int, int], event: dev.Event) -> None:
        """Record that ``unit``'s gradients are on their way to :attr:`host_grads`."""
        self.events[unit] = event

    def submit(self, unit: tuple[int, int], *, lr: float, scale: float) -> None:
        """Asynchronous OPTIM_STEP: a worker waits for the offload, checks and steps."""
        stage = self._stage(unit)
        self.threads.submit_step(stage.name, self.host_grads[unit], self.events.get(unit), scale=scale, lr=lr)

    def validate_async(self, *, lr: float) -> StepOutcome:
        """Wait for the workers, then SysX's post-step validation (rollback / clipping re-step)."""
        reports = self.threads.wait()
        self.outcome = post_step_validate(reports, self.threads, self.scaler, lr=lr,
                                          max_grad_norm=self.settings.grad_clip, group=self.group)
        return self.outcome

    def validate_sync(self, *, scale: float) -> StepOutcome:
        """Validate first (baselines): load and check every offloaded sub-stage, reduce, decide."""
        t0 = time.perf_counter()
        names = {self.stages[u].name: u for u in self.events}

        def load(stage: StageOptimizer) -> tuple[bool, float]:
            unit = names[stage.name]
            self.events[unit].synchronize()
            stage.new_iteration()
            return stage.load_grads(self.host_grads[unit], scale=scale)

        checks = self.threads.run_all(load, list(names), "check")
        n_inf, sq = reduce_flags([c[0] for c in checks], [c[1] for c in checks], self.group)
        if n_inf > 0 or not math.isfinite(sq):
            skipped = self.scaler.update(True)
            self.outcome = StepOutcome(True, bool(skipped), math.inf, 1.0, scale, float(self.scaler.scale), 0, 0,
                                       time.perf_counter() - t0)
            return self.outcome
        self.scaler.update(False)
        norm = math.sqrt(sq)
        coef = clip_coefficient(norm, self.settings.grad_clip)
        self.outcome = StepOutcome(False, False, norm, coef, scale, float(self.scaler.scale), 0, 0, time.perf_counter() - t0)
        return self.outcome

    def step_sync(self, unit: tuple[int, int], *, lr: float) -> None:
        """Synchronous OPTIM_STEP after :meth:`validate_sync`: clip and step ``unit`` (unless skipped)."""
        if self.outcome is None:
            raise RuntimeError(f"OPTIM_STEP s{unit[0]}.{unit[1]}: a synchronous step needs VALIDATE first")
        if self.outcome.skipped:
            return
        stage = self._stage(unit)
        if self.outcome.clip_coef < 1.0:
            stage.grad32.mul_(self.outcome.clip_coef)
        stage.apply(lr)

    def _stage(self, unit: tuple[int, int]) -> StageOptimizer:
        try:
            return self.stages[unit]
        except KeyError:
            raise RuntimeError(f"sub-stage s{unit[0]}.{unit[1]} is not owned by this rank (owned: "
                               f"{sorted(self.stages)}); its optimizer lives on the rank running its backward") from None

    # ------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Join the worker threads and release the optimizers (their views of shared memory too)."""
        threads, self.threads = getattr(self, "threads", None), None
        if threads is not None:
            threads.close()
            threads.stages.clear()
        for stage in self.stages.values():
            stage.close()
        self.stages.clear()
        self.host_grads.clear()
        self.events = {}
