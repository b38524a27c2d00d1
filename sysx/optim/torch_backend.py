"""The torch backend of :class:`sysx.optim.CpuAdam`: DeepSpeed's formula in in-place torch ops.

Each call works on one chunk (a contiguous slice of the flat buffers, sized to stay in cache);
every op is an ATen kernel that releases the GIL and uses the calling thread's intra-op threads.
The constants come from :mod:`sysx.optim.formula` (fp32, DeepSpeed's), so this backend differs
from DeepSpeed only by fp32 rounding order (no FMAs). :meth:`TorchBackend.direction_chunk` repeats the
exact ops the step used to form ``m / denom``, so :mod:`sysx.optim.undo` inverts a step with the
same update the step applied.
"""

from __future__ import annotations

import torch

from sysx.optim.formula import Hyper, StepConstants

CHUNK_ELEMS = 1 << 18  # 1 MiB of fp32 per buffer: five buffers stay in L2/L3


def cpu_capability() -> str:
    """The SIMD level ATen dispatches to on this CPU (e.g. ``AVX512``, ``AVX2``, ``DEFAULT``)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


class TorchBackend:
    """DeepSpeed's AdamW step on fp32 chunks with vectorised ATen ops (no extension to build)."""

    name = "torch"
    chunk_elems = CHUNK_ELEMS

    def __init__(self, hyper: Hyper) -> None:
        self.hyper = hyper

    @property
    def simd(self) -> str:
        """What the vector width is, for the start-up log."""
        return f"ATen {cpu_capability()}"

    def step_chunk(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        c: StepConstants,
        scratch: torch.Tensor,
    ) -> None:
        """One AdamW step in place on a chunk; ``scratch`` is fp32 of the same length."""
        m.mul_(c.beta1).add_(g, alpha=c.one_minus_beta1)
        v.mul_(c.beta2).addcmul_(g, g, value=c.one_minus_beta2)
        self.direction_chunk(m, v, c, scratch)
        if c.weight_decay > 0:
            p.add_(p, alpha=c.decay)
        p.add_(scratch, alpha=c.step_size)

    def direction_chunk(self, m: torch.Tensor, v: torch.Tensor, c: StepConstants, out: torch.Tensor) -> None:
        """``out = m / (sqrt(v) * bc2 + eps)`` with the very ops :meth:`step_chunk` uses."""
        torch.sqrt(v, out=out)
        out.mul_(c.bias_correction2_inv).add_(c.eps)
        torch.div(m, out, out=out)

    def resume_at(self, step: int) -> None:
        """Nothing to replay: every step's constants come from :class:`CpuAdam`."""

    def close(self) -> None:
        """Nothing to release."""
