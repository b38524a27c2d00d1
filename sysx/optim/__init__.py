"""Host-side optimizer: CPU Adam with exact undo, loss scaling, LR schedule, per-stage threads.

* :class:`CpuAdam` - AdamW over one flat fp32 buffer (DeepSpeed or torch backend), ``undo``;
  rollback modes ``undo`` / ``snapshot`` / ``exact`` (:mod:`sysx.optim.exact`: two buffer sets, the
  backend's in-place step on the spare, a background refresh); ``auto`` is resolved against the host budget
  by :mod:`sysx.optim.rollback_choice`; ``sysx bench optim`` times them (:mod:`sysx.optim.bench_modes`);
* :class:`StageOptimizer`, :class:`OptimizerThreads` - one sub-stage's optimizer and the
  worker threads that step sub-stages as their gradients arrive;
* :func:`post_step_validate` (SysX) and :func:`sync_step` (baselines, in two parts:
  :func:`load_and_check` / :func:`check_reports` and :func:`apply_checked`) - overflow check,
  global-norm clipping and rollback across stages and ranks, for the pipeline and the window;
* :class:`StepProtocol` - the one speculate-or-validate decision per step both trainers call (which
  jobs step at once, the validation, the device lane's steps, the spare refresh);
* :func:`plan_cores` / :func:`apply_plan` - thread counts per local rank;
* :func:`lr_at`, :func:`make_scaler` and the loss scalers.

Submodules load on demand, so ``import sysx.optim`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "CpuAdam": "sysx.optim.cpu_adam",
    "StageOptimizer": "sysx.optim.stage",
    "StageReport": "sysx.optim.stage",
    "OptimSettings": "sysx.optim.stage",
    "OptimizerThreads": "sysx.optim.threads",
    "StepOutcome": "sysx.optim.validation",
    "post_step_validate": "sysx.optim.validation",
    "sync_step": "sysx.optim.validation",
    "load_and_check": "sysx.optim.validation",
    "check_reports": "sysx.optim.validation",
    "apply_checked": "sysx.optim.validation",
    "StepProtocol": "sysx.optim.step_protocol",
    "CorePlan": "sysx.optim.cores",
    "plan_cores": "sysx.optim.cores",
    "apply_plan": "sysx.optim.cores",
    "DeepSpeedUnavailable": "sysx.optim.deepspeed_backend",
    "lr_at": "sysx.optim.lr_schedule",
    "DynamicLossScaler": "sysx.optim.loss_scaler",
    "FiniteCheckScaler": "sysx.optim.loss_scaler",
    "LossScaleTooSmall": "sysx.optim.loss_scaler",
    "NonFiniteGradients": "sysx.optim.loss_scaler",
    "make_scaler": "sysx.optim.loss_scaler",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sysx.optim' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
