"""The AdamW formula of DeepSpeed's CPU Adam, with its fp32 constants, shared by both backends.

:class:`BetaPowers` mirrors DeepSpeed's running ``b1^t`` / ``b2^t``, so the torch backend and
:mod:`sysx.optim.undo` use the very constants DeepSpeed used; :func:`reference_step` is the formula
in numpy that the backends are checked against.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

_F = np.float32


@dataclass(frozen=True)
class Hyper:
    """Optimizer hyper-parameters (fixed for the optimizer's life except ``lr``)."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def check(self) -> None:
        """Raise ValueError naming any value out of range."""
        if not 0.0 <= self.beta1 < 1.0:
            raise ValueError(f"CpuAdam: betas[0]={self.beta1} must be in [0, 1)")
        if not 0.0 < self.beta2 < 1.0:
            raise ValueError(f"CpuAdam: betas[1]={self.beta2} must be in (0, 1)")
        if not (self.eps > 0.0 and math.isfinite(self.eps)):
            raise ValueError(f"CpuAdam: eps={self.eps} must be finite and > 0")
        if not (self.weight_decay >= 0.0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"CpuAdam: weight_decay={self.weight_decay} must be finite and >= 0")


@dataclass(frozen=True)
class StepConstants:
    """The fp32 constants of step ``step`` (1-based), exactly as DeepSpeed's kernel sees them.

    Python floats holding fp32 values (so torch ops with these scalars round identically).
    """

    step: int
    lr: float
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    bias_correction2_inv: float  # 1 / sqrt(1 - b2^t)
    step_size: float  # -lr / (1 - b1^t)
    decay: float  # -lr * wd  (p <- p + decay * p)

    def undecayed(self) -> StepConstants:
        """The same step without weight decay (the runs of 1-D parameters, :mod:`sysx.optim.decay`)."""
        return dataclasses.replace(self, weight_decay=0.0, decay=0.0)


class BetaPowers:
    """DeepSpeed's running ``b1^t, b2^t`` (``Adam_Optimizer::IncrementStep``), state included."""

    def __init__(self, beta1: float, beta2: float) -> None:
        self.beta1 = _F(beta1)
        self.beta2 = _F(beta2)
        self._step = 0
        self._b1t = _F(1.0)
        self._b2t = _F(1.0)

    def at(self, step: int) -> tuple[np.float32, np.float32]:
        """Advance like DeepSpeed for a call with ``step`` and return ``(b1^t, b2^t)``."""
        if step == self._step + 1:
            self._step += 1
            self._b1t = _F(self._b1t * self.beta1)
            self._b2t = _F(self._b2t * self.beta2)
        elif step != self._step:
            # std::pow(float, size_t) promotes to double; the result is stored as float.
            self._b1t = _F(float(self.beta1) ** step)
            self._b2t = _F(float(self.beta2) ** step)
            self._step = step
        return self._b1t, self._b2t


def constants(step: int, lr: float, hyper: Hyper, powers: BetaPowers) -> StepConstants:
    """The constants of one DeepSpeed ``adam_update(step, lr, ...)`` call (advances ``powers``)."""
    if step < 1:
        raise ValueError(f"CpuAdam: step={step} must be >= 1 (steps are 1-based)")
    b1t, b2t = powers.at(step)
    one = _F(1.0)
    alpha = _F(lr)
    bc1 = _F(one - b1t)
    bc2_inv = _F(one / np.sqrt(_F(one - b2t)))
    return StepConstants(
        step=step,
        lr=float(alpha),
        beta1=float(powers.beta1),
        beta2=float(powers.beta2),
        one_minus_beta1=float(_F(one - powers.beta1)),
        one_minus_beta2=float(_F(one - powers.beta2)),
        eps=float(_F(hyper.eps)),
        weight_decay=float(_F(hyper.weight_decay)),
        bias_correction2_inv=float(bc2_inv),
        step_size=float(_F(-alpha) / bc1),
        decay=float(_F(-alpha) * _F(hyper.weight_decay)),
    )


def reference_step(
    p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, c: StepConstants
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSpeed's AVX path in numpy: fp64 arithmetic rounded to fp32 where the kernel rounds.

    Returns new ``(p, m, v)`` as fp32 arrays; used by the DeepSpeed self-test and the tests.
    """
    f32, f64 = np.float32, np.float64
    g64 = g.astype(f64)
    m1 = (g64 * f64(c.one_minus_beta1) + (m * f32(c.beta1)).astype(f64)).astype(f32)
    gg = (g * g).astype(f32).astype(f64)
    v1 = (gg * f64(c.one_minus_beta2) + (v * f32(c.beta2)).astype(f64)).astype(f32)
    s = np.sqrt(v1.astype(f64)).astype(f32).astype(f64)
    d = (s * f64(c.bias_correction2_inv) + f64(c.eps)).astype(f32)
    u = (m1.astype(f64) / d.astype(f64)).astype(f32).astype(f64)
    p64 = p.astype(f64)
    if c.weight_decay > 0:
        p64 = (p64 * f64(c.decay) + p64).astype(f32).astype(f64)
    p1 = (u * f64(c.step_size) + p64).astype(f32)
    return p1, m1, v1


def elements_off(got: np.ndarray, want: np.ndarray, ulps: int = 4) -> tuple[int, float]:
    """How many fp32 elements of ``got`` lie more than ``ulps`` relative fp32 epsilons from ``want``,
    and the largest absolute difference (the backends' load-time self-tests against :func:`reference_step`)."""
    want = np.ascontiguousarray(want, dtype=np.float32)
    diff = np.abs(np.asarray(got, dtype=np.float32) - want)
    tol = ulps * np.finfo(np.float32).eps * np.maximum(np.abs(want), np.float32(1e-30))
    return int((diff > tol).sum()), float(diff.max()) if diff.size else 0.0
