"""Rolling back one AdamW step: the arithmetic inverse (``undo``) or a copy (``snapshot``).

``undo`` (:func:`undo_chunk`) inverts DeepSpeed's step (:mod:`sysx.optim.formula`) given the same
gradients, with no extra memory and an error of about one fp32 ulp; :class:`Snapshot` copies
``p, m, v`` before the step (12 bytes per parameter) and restores them bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sysx.optim.formula import StepConstants

Direction = Callable[[torch.Tensor, torch.Tensor, StepConstants, torch.Tensor], None]

UNDO_CHUNK = 1 << 16  # elements per inner block: the fp64 work buffers (512 KiB each) stay in cache


class UndoWorkspace:
    """Preallocated work buffers of one optimizer's undo (no allocation per call)."""

    def __init__(self) -> None:
        self.u = torch.empty(UNDO_CHUNK, dtype=torch.float32)
        self.a = torch.empty(UNDO_CHUNK, dtype=torch.float64)


def undo_chunk(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    c: StepConstants,
    direction: Direction,
    ws: UndoWorkspace,
) -> None:
    """Invert one step in place on a chunk: ``direction`` is the backend's ``m / denom``."""
    n = p.numel()
    inv_decay = 1.0 / (1.0 + c.decay)
    inv_b1 = 1.0 / c.beta1 if c.beta1 > 0 else 0.0
    inv_b2 = 1.0 / c.beta2
    for lo in range(0, n, UNDO_CHUNK):
        hi = min(n, lo + UNDO_CHUNK)
        k = hi - lo
        P, G, M, V = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
        u, a = ws.u[:k], ws.a[:k]
        direction(M, V, c, u)  # from the updated moments, before touching them
        a.copy_(P)
        a.add_(u, alpha=-c.step_size)  # mixed-dtype in-place ops compute in fp64
        if c.weight_decay > 0:
            a.mul_(inv_decay)  # fp64 multiply by the reciprocal: 1e-16 off, far below fp32 rounding
        P.copy_(a)
        torch.mul(G, G, out=u)  # the step squares in fp32
        a.copy_(V)
        a.sub_(u, alpha=c.one_minus_beta2).mul_(inv_b2).clamp_min_(0.0)
        V.copy_(a)
        a.copy_(M)
        a.sub_(G, alpha=c.one_minus_beta1)
        if c.beta1 > 0:
            a.mul_(inv_b1)
        M.copy_(a)


class Snapshot:
    """Host copies of ``p, m, v`` taken chunk by chunk right before each step."""

    def __init__(self, numel: int) -> None:
        self.p = torch.empty(numel, dtype=torch.float32)
        self.m = torch.empty(numel, dtype=torch.float32)
        self.v = torch.empty(numel, dtype=torch.float32)

    @property
    def nbytes(self) -> int:
        """Host memory held by the copies."""
        return 3 * self.p.numel() * self.p.element_size()

    def save(self, lo: int, hi: int, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """Copy one chunk (elements ``lo:hi``) of the current state."""
        self.p[lo:hi].copy_(p)
        self.m[lo:hi].copy_(m)
        self.v[lo:hi].copy_(v)

    def restore(self, lo: int, hi: int, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """Copy one chunk back, bit for bit."""
        p.copy_(self.p[lo:hi])
        m.copy_(self.m[lo:hi])
        v.copy_(self.v[lo:hi])
