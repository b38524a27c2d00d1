"""One backward sub-stage's share of the host optimizer.

A :class:`StageOptimizer` owns the sub-stage's flat fp32 master weights (through its
:class:`~sysx.optim.CpuAdam`), an fp32 gradient buffer and, optionally, a *target* tensor that
receives the new working copy of the parameters after every change (the 16-bit view into the
shared parameter store; any dtype and any host tensor works). Its operations:

* :meth:`load_grads` converts the (16-bit or fp32) gradients to fp32, divides by the loss scale
  and returns the local overflow flag and squared L2 norm (accumulated in fp64, so finite fp32
  gradients never read as overflow);
* :meth:`apply` steps (only called when the local gradients are finite) and writes the target;
* :meth:`undo` rolls the step back and rewrites the target;
* :meth:`restep` undoes and steps again with the gradients multiplied by a clip coefficient.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from sysx.optim.cpu_adam import CpuAdam

CHUNK_ELEMS = 1 << 18


@dataclass
class StageReport:
    """What one stage's optimizer job did (times are ``time.perf_counter()`` seconds)."""

    stage: str
    found_inf: bool = False
    sq_norm: float = 0.0  # squared L2 norm of the unscaled fp32 gradients (inf/nan on overflow)
    stepped: bool = False
    t_submit: float = 0.0  # handed to the worker
    t_ready: float = 0.0  # gradients on the host (event complete)
    t_done: float = 0.0  # step finished and target written
    thread: str = ""
    extra: dict[str, float] = field(default_factory=dict)


class StageOptimizer:
    """Master weights, Adam state, fp32 gradients and the parameter target of one sub-stage."""

    def __init__(
        self,
        name: str,
        master: torch.Tensor,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        backend: str = "deepspeed",
        rollback: str = "undo",
        target: torch.Tensor | None = None,
        grad_buffer: torch.Tensor | None = None,
    ) -> None:
        self.name = name
        self.optimizer = CpuAdam(
            master, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, backend=backend, rollback=rollback
        )
        n = self.optimizer.numel
        if target is not None and target.numel() != n:
            raise ValueError(f"stage {name}: target has {target.numel()} elements, the master weights {n}")
        if target is not None and target.device.type != "cpu":
            raise ValueError(f"stage {name}: target is on {target.device}; it must be a host tensor (shared store view)")
        self.target = target.view(-1) if target is not None else None
        if grad_buffer is None:
            grad_buffer = torch.empty(n, dtype=torch.float32)
        if grad_buffer.dtype != torch.float32 or grad_buffer.numel() != n or not grad_buffer.is_contiguous():
            raise ValueError(f"stage {name}: grad_buffer must be a contiguous fp32 tensor of {n} elements")
        self.grad32 = grad_buffer.view(-1)
        self.stepped = False

    @property
    def master(self) -> torch.Tensor:
        """The flat fp32 master weights."""
        return self.optimizer.param

    @property
    def numel(self) -> int:
        """Number of parameters of this stage."""
        return self.optimizer.numel

    def _chunks(self) -> list[tuple[int, int]]:
        n = self.numel
        return [(lo, min(n, lo + CHUNK_ELEMS)) for lo in range(0, n, CHUNK_ELEMS)]

    def load_grads(self, grads: torch.Tensor, *, scale: float = 1.0) -> tuple[bool, float]:
        """Copy ``grads`` (any float dtype, host) into the fp32 buffer divided by ``scale``.

        Returns ``(found_inf, squared_norm)`` of the unscaled fp32 gradients.
        """
        if grads.numel() != self.numel:
            raise ValueError(f"stage {self.name}: gradients have {grads.numel()} elements, the parameters {self.numel}")
        if grads.device.type != "cpu":
            raise ValueError(f"stage {self.name}: gradients are on {grads.device}; copy them to the host first")
        src = grads.reshape(-1)
        sq = 0.0
        for lo, hi in self._chunks():
            g = self.grad32[lo:hi]
            if src.data_ptr() != self.grad32.data_ptr():
                g.copy_(src[lo:hi])
            if scale != 1.0:
                g.div_(scale)
            sq += float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2
        return (not math.isfinite(sq)), sq

    def apply(self, lr: float) -> None:
        """Step with the loaded gradients and write the target."""
        self.optimizer.step(self.grad32, lr=lr)
        self.stepped = True
        self.write_target()

    def undo(self) -> None:
        """Roll back the step of this iteration (if one was taken) and rewrite the target."""
        if not self.stepped:
            return
        self.optimizer.undo(self.grad32)
        self.stepped = False
        self.write_target()

    def restep(self, coef: float, lr: float) -> None:
        """Undo, multiply the gradients by ``coef`` (clipping) and step again."""
        if not self.stepped:
            raise RuntimeError(f"stage {self.name}: restep without a step to redo")
        self.optimizer.undo(self.grad32)
        self.stepped = False
        self.grad32.mul_(coef)
        self.apply(lr)

    def write_target(self) -> None:
        """Copy the masters into the target (casting to its dtype), chunk by chunk."""
        if self.target is None:
            return
        for lo, hi in self._chunks():
            self.target[lo:hi].copy_(self.master[lo:hi])

    def new_iteration(self) -> None:
        """Forget the previous iteration's step (it was validated)."""
        self.stepped = False

    def close(self) -> None:
        """Release the optimizer backend."""
        self.optimizer.close()


def now() -> float:
    """The clock of :class:`StageReport`."""
    return time.perf_counter()
