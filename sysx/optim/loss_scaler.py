"""Loss scaling: dynamic for fp16, a finiteness check only for bf16 and fp32.

fp16 gradients overflow easily, so the loss is multiplied by ``scale`` before backward and the
gradients are divided by it before the step. :class:`DynamicLossScaler` halves the scale (by
``backoff_factor``) on every step whose gradients are not finite (that step is skipped) and grows
it (by ``growth_factor``) after ``growth_interval`` finite steps in a row. When it would fall below
``min_scale`` it raises :class:`LossScaleTooSmall`: training has diverged, scaling cannot help.

bf16 and fp32 need no scaling (:class:`FiniteCheckScaler`, scale 1): a non-finite gradient there
is not an overflow to skip but a divergence, so ``update(True)`` raises
:class:`NonFiniteGradients`.
"""

from __future__ import annotations

import math
from typing import Any

from sysx.config.choices import PRECISIONS


class LossScaleTooSmall(RuntimeError):
    """The dynamic loss scale would drop below its minimum: the gradients keep overflowing."""


class NonFiniteGradients(RuntimeError):
    """A bf16/fp32 step produced inf/nan gradients (no loss scale exists to back off)."""


class DynamicLossScaler:
    """fp16 dynamic loss scale with backoff on overflow and periodic growth."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
    ) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"DynamicLossScaler: init_scale={init_scale} must be finite and > 0")
        if not growth_factor >= 1.0:
            raise ValueError(f"DynamicLossScaler: growth_factor={growth_factor} must be >= 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"DynamicLossScaler: backoff_factor={backoff_factor} must be in (0, 1)")
        if growth_interval < 1:
            raise ValueError(f"DynamicLossScaler: growth_interval={growth_interval} must be >= 1")
        if not min_scale > 0:
            raise ValueError(f"DynamicLossScaler: min_scale={min_scale} must be > 0")
        if init_scale < min_scale:
            raise ValueError(f"DynamicLossScaler: init_scale={init_scale} is below min_scale={min_scale}")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.skipped_steps = 0
        self._good_steps = 0

    def update(self, found_inf: bool) -> bool:
        """Record one step's outcome; returns True when that step must be skipped.

        On overflow the scale backs off (raising :class:`LossScaleTooSmall` if it would go below
        ``min_scale``); after ``growth_interval`` finite steps in a row it grows.
        """
        if found_inf:
            new_scale = self.scale * self.backoff_factor
            if new_scale < self.min_scale:
                raise LossScaleTooSmall(
                    f"fp16 loss scale would drop to {new_scale:g}, below min_scale={self.min_scale:g}, after "
                    f"{self.skipped_steps + 1} skipped step(s): gradients overflow at every scale. Lower the "
                    "learning rate, enable gradient clipping, or train in bf16 (precision=bf16)"
                )
            self.scale = new_scale
            self._good_steps = 0
            self.skipped_steps += 1
            return True
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0
        return False

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly."""
        return {
            "kind": "dynamic",
            "scale": self.scale,
            "good_steps": self._good_steps,
            "skipped_steps": self.skipped_steps,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "min_scale": self.min_scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (the hyper-parameters come from the saved state)."""
        if state.get("kind") != "dynamic":
            raise ValueError(f"DynamicLossScaler.load_state_dict: state kind {state.get('kind')!r} is not 'dynamic'")
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.min_scale = float(state["min_scale"])


class FiniteCheckScaler:
    """bf16/fp32: scale fixed at 1; a non-finite gradient raises :class:`NonFiniteGradients`."""

    def __init__(self, precision: str = "fp32") -> None:
        self.precision = precision
        self.scale = 1.0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> bool:
        """Returns False (never skips); raises :class:`NonFiniteGradients` when ``found_inf``."""
        if found_inf:
            raise NonFiniteGradients(
                f"precision={self.precision}: the gradients contain inf/nan (training diverged; no loss "
                "scale to back off). Lower optim.lr, enable optim.grad_clip, or check the data"
            )
        return False

    def state_dict(self) -> dict[str, Any]:
        """State for checkpoints (nothing changes over training)."""
        return {"kind": "finite_check", "precision": self.precision, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        if state.get("kind") != "finite_check":
            raise ValueError(
                f"FiniteCheckScaler.load_state_dict: state kind {state.get('kind')!r} is not 'finite_check'"
            )
        self.skipped_steps = int(state["skipped_steps"])


LossScaler = DynamicLossScaler | FiniteCheckScaler

_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale")


def make_scaler(precision: str, **kw: Any) -> LossScaler:
    """The scaler for ``precision``: fp16 -> :class:`DynamicLossScaler` (``kw`` are its
    arguments), bf16/fp32 -> :class:`FiniteCheckScaler` (the same ``kw`` are accepted and ignored
    so callers can pass one config for every precision)."""
    unknown = sorted(set(kw) - set(_SCALER_KEYS))
    if unknown:
        raise TypeError(f"make_scaler: unknown argument(s) {unknown}; allowed: {list(_SCALER_KEYS)}")
    if precision == "fp16":
        return DynamicLossScaler(**kw)
    if precision in ("bf16", "fp32"):
        return FiniteCheckScaler(precision)
    raise ValueError(f"make_scaler: precision={precision!r} is not one of {list(PRECISIONS)}")
