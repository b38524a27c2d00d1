"""The device lane of the optimizer (Deep Optimizer States): a host :class:`~sysx.optim.CpuAdam`'s
step taken on a device.

:class:`DeviceLane` copies a unit's fp32 gradients, master weights and Adam moments to the device,
steps them with the torch backend's ops and copies them back. The step comes after the validation's
decision, so it is never rolled back. On an emulated device (``DeviceLane(None)``) the host optimizer
takes the step and the pacer charges its modelled time.
"""

from __future__ import annotations

import torch

from sysx.optim.cpu_adam import CpuAdam
from sysx.optim.decay import decay_runs
from sysx.optim.torch_backend import CHUNK_ELEMS, TorchBackend


class DeviceLane:
    """Steps host optimizers on ``device`` (None: an emulated device, see docs/architecture.md), reusing
    one set of device buffers (grown on demand). ``lent``: device bytes (uint8) the lane may use
    instead, idle whenever it steps (the sliding window lends its activation ring); a unit larger
    than them gets buffers of its own."""

    def __init__(self, device: torch.device | str | None, lent: torch.Tensor | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self._bufs: torch.Tensor | None = None  # 5 x n: g, p, m, v, scratch
        self._lent = lent

    def _buffers(self, n: int) -> torch.Tensor:
        lent = self._lent
        if lent is not None and lent.numel() >= 5 * n * 4:
            return lent[: 5 * n * 4].view(torch.float32).view(5, n)
        if self._bufs is None or self._bufs.shape[1] < n:
            self._bufs = torch.empty(5, n, dtype=torch.float32, device=self.device)
        return self._bufs[:, :n]

    def step(self, opt: CpuAdam, grad: torch.Tensor, *, lr: float) -> None:
        """One AdamW step of ``opt`` with the host fp32 ``grad``, computed on the device."""
        if grad.dtype != torch.float32 or grad.numel() != opt.numel:
            raise ValueError(
                f"DeviceLane.step: grad must be fp32 with {opt.numel} elements, got {grad.dtype} with {grad.numel()}"
            )
        if self.device is None:
            opt.step(grad, lr=lr, final=True)  # after the validation, as on a device: never undone
            return
        c = opt.take_step(lr)
        n = opt.numel
        g, p, m, v, scratch = self._buffers(n)
        host = (grad.view(-1), opt.param, opt.exp_avg, opt.exp_avg_sq)
        for dst, src in zip((g, p, m, v), host):
            dst.copy_(src, non_blocking=True)
        backend = TorchBackend(opt.hyper)
        plain = c.undecayed()
        # the torch backend's runs (its chunks cut at the no-decay edges): the same rounding, element by element
        for lo, hi, decays in decay_runs(n, CHUNK_ELEMS, opt.no_decay):
            run_c = c if decays else plain
            backend.step_chunk(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], run_c, scratch[lo:hi])
        for dst, src in zip(host[1:], (p, m, v)):
            dst.copy_(src)  # blocking: the host state is current when this returns
        opt.state_written()  # rollback=exact: the spare set is stale now

    def close(self) -> None:
        """Free the device buffers (and give back the lent ones)."""
        self._bufs = self._lent = None
