"""``optim.rollback=exact``: two sets of ``(p, m, v)``, a step writes the other set, a rollback is a switch.

:class:`ExactState` holds the caller's parameters with fresh ``m, v`` as set 0 and a spare
``(p, m, v)`` as set 1 (12 bytes per parameter more, as ``rollback=snapshot``). A step reads the
current set and writes the new values into the other, which then becomes current; the post-step
validation either keeps it (commit: the next step reads it) or switches back (rollback): the state
is then bit for bit the state before the step, at no cost. No copy is made at any point.

The out-of-place step is, by backend:

* ``deepspeed`` (or ``auto`` when it builds): the C++ kernel of :mod:`sysx.optim.exact_kernel`,
  DeepSpeed's arithmetic bit for bit, streaming stores, the time of DeepSpeed's in-place step;
* ``torch`` (or ``auto`` when the kernel cannot be built: a warning says so): the ATen ops of
  :class:`sysx.optim.torch_backend.TorchBackend` with ``out=``, bit for bit that backend's step.

Which one runs is logged once per process.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Protocol

import torch

from sysx.optim.formula import Hyper, StepConstants

log = logging.getLogger("sysx.optim")

CHUNK_ELEMS = 1 << 20  # elements per kernel call: 4 MiB, keeps every chunk offset 64-byte aligned
Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class OutOfPlaceStep(Protocol):
    """One AdamW step from ``src = (p, m, v)`` into ``dst``."""

    name: str  # whose arithmetic: "deepspeed" or "torch"
    chunk_elems: int

    def step_into(self, src: Triple, grad: torch.Tensor, dst: Triple, c: StepConstants) -> None: ...


class KernelStep:
    """The C++ kernel (DeepSpeed's arithmetic, streaming stores)."""

    name = "deepspeed"
    chunk_elems = CHUNK_ELEMS

    def __init__(self) -> None:
        from sysx.optim.exact_kernel import load_kernel

        self._op = load_kernel()

    def describe(self) -> str:
        """For the start-up log."""
        return f"C++ out-of-place kernel, DeepSpeed arithmetic, SIMD {self._op.simd()}, streaming stores"

    def step_into(self, src: Triple, grad: torch.Tensor, dst: Triple, c: StepConstants) -> None:
        """One chunk (contiguous fp32, same length everywhere)."""
        from sysx.optim.exact_kernel import step_into

        step_into(self._op, src, grad, dst, c)


class TorchStep:
    """:class:`sysx.optim.torch_backend.TorchBackend`'s step written out of place (same ops, ``out=``)."""

    name = "torch"
    chunk_elems = 1 << 18  # as the torch backend: five chunk buffers stay in cache

    def __init__(self) -> None:
        self._scratch: torch.Tensor | None = None

    def describe(self) -> str:
        """For the start-up log."""
        return "torch out-of-place ops (the torch backend's arithmetic)"

    def step_into(self, src: Triple, grad: torch.Tensor, dst: Triple, c: StepConstants) -> None:
        """One chunk; every op is the one the in-place torch backend applies, so results match it bit for bit."""
        p, m, v = src
        p1, m1, v1 = dst
        k = grad.numel()
        if self._scratch is None or self._scratch.numel() < k:
            self._scratch = torch.empty(max(k, self.chunk_elems), dtype=torch.float32)
        d = self._scratch[:k]
        torch.mul(m, c.beta1, out=m1).add_(grad, alpha=c.one_minus_beta1)
        torch.mul(v, c.beta2, out=v1).addcmul_(grad, grad, value=c.one_minus_beta2)
        torch.sqrt(v1, out=d)
        d.mul_(c.bias_correction2_inv).add_(c.eps)
        torch.div(m1, d, out=d)
        if c.weight_decay > 0:
            torch.add(p, p, alpha=c.decay, out=p1)
        else:
            p1.copy_(p)
        p1.add_(d, alpha=c.step_size)


_logged = False
_log_lock = threading.Lock()


def make_step(backend: str) -> KernelStep | TorchStep:
    """The out-of-place step for ``optim.backend`` (``auto`` falls back from the kernel to torch with a warning)."""
    global _logged
    if backend == "torch":
        step: KernelStep | TorchStep = TorchStep()
    else:
        from sysx.optim.exact_kernel import ExactKernelUnavailable

        try:
            step = KernelStep()
        except ExactKernelUnavailable as exc:
            if backend != "auto":
                raise
            message = (f"optim.rollback=exact: the C++ kernel is unavailable, FALLING BACK to torch out-of-place ops "
                       f"(the torch backend's arithmetic): {exc}")
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            step = TorchStep()
    with _log_lock:
        if not _logged:
            _logged = True
            log.info("optim.rollback=exact: steps by %s", step.describe())
    return step


class ExactState:
    """Two ``(p, m, v)`` sets of one flat fp32 parameter buffer (see the module doc)."""

    def __init__(self, param: torch.Tensor, backend: str, hyper: Hyper) -> None:
        n = param.numel()
        # set 0 is the caller's parameters; the spare set is fresh 64-byte aligned allocations
        self.sets: list[Triple] = [
            (param, torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.float32)),
            (torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)),
        ]
        self.current = 0
        self.hyper = hyper
        self._step = make_step(backend)

    @property
    def backend(self) -> str:
        """Whose arithmetic the steps use (``deepspeed`` or ``torch``)."""
        return self._step.name

    @property
    def spare_bytes(self) -> int:
        """Host memory of the second set (12 bytes per parameter)."""
        return sum(t.numel() * t.element_size() for t in self.sets[1])

    @property
    def state(self) -> Triple:
        """The current ``(p, m, v)``."""
        return self.sets[self.current]

    def step(self, grad: torch.Tensor, c: StepConstants) -> None:
        """Write the stepped state into the other set and make it current."""
        src, dst = self.sets[self.current], self.sets[1 - self.current]
        n, size = grad.numel(), self._step.chunk_elems
        for lo in range(0, n, size):
            hi = min(n, lo + size)
            self._step.step_into((src[0][lo:hi], src[1][lo:hi], src[2][lo:hi]), grad[lo:hi],
                                 (dst[0][lo:hi], dst[1][lo:hi], dst[2][lo:hi]), c)
        self.current = 1 - self.current

    def switch_back(self) -> None:
        """Roll the last step back: the set it read is current again, untouched."""
        self.current = 1 - self.current
