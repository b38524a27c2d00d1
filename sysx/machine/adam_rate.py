"""One CPU Adam thread's rate (parameters stepped per second) on this machine: what the autotune
profile, the pipeline's optimizer placement and the single-GPU lanes weigh the CPU lane by."""

from __future__ import annotations

import torch

from sysx.machine.hardware import time_op
from sysx.optim.cores import intra_op_threads
from sysx.optim.cpu_adam import CpuAdam


def adam_params_per_s(numel: int = 1 << 20, *, threads: int = 1, backend: str = "auto", repeat: int = 3) -> float:
    """CPU Adam throughput (parameters stepped per second) of one optimizer with ``threads`` intra-op
    threads: the fastest of ``repeat`` steps after a warm-up."""
    p = torch.randn(numel) * 0.02
    g = torch.randn(numel) * 1e-2
    opt = CpuAdam(p, lr=1e-3, weight_decay=0.1, backend=backend)
    try:
        with intra_op_threads(threads):
            seconds = time_op(lambda: opt.step(g), torch.device("cpu"), repeat, fastest=True)
    finally:
        opt.close()
    return numel / max(seconds, 1e-9)
