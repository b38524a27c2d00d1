"""Host-side optimizer: CPU Adam with rollback, per-stage threads, step validation, loss scaling, LR schedule.

:class:`CpuAdam` (AdamW over one flat fp32 buffer), :class:`StageOptimizer` and :class:`OptimizerThreads`
(one sub-stage's optimizer and the workers that step them), :func:`post_step_validate` / :func:`sync_step`
(the two validation orders), :class:`StepProtocol` (the per-step speculate-or-validate decision),
:func:`plan_cores` / :func:`apply_plan` (threads per local rank), :func:`lr_at`, :func:`make_scaler`.
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
