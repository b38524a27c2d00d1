"""One CPU Adam thread's rate (parameters stepped per second) on this machine: what the pipeline's
optimizer placement and the single-GPU lanes weigh the CPU lane by; and the rate of a whole
optimizer job (gradients loaded and checked, the step, the working copy written), what a pipeline
plan charges for each job (the autotune profile)."""

from __future__ import annotations

import torch

from sysx.machine.hardware import time_op
from sysx.optim.cores import intra_op_threads
from sysx.optim.cpu_adam import CpuAdam
from sysx.optim.stage import StageOptimizer


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


def optimizer_job_params_per_s(
    numel: int = 1 << 20,
    *,
    dtype: torch.dtype = torch.bfloat16,
    threads: int = 1,
    backend: str = "auto",
    repeat: int = 3,
) -> float:
    """Parameters per second of one optimizer worker's job on ``threads`` intra-op threads: ``dtype``
    gradients converted to fp32 and their norm taken, the Adam step, the ``dtype`` working copy
    written (:func:`sysx.optim.threads._step_job`'s work); the fastest of ``repeat`` after a warm-up.
    2.4-2.5x the Adam step's time alone on a 16-bit job on the Xeon VM (profiling/RESULTS.md)."""
    master = torch.randn(numel) * 0.02
    grads = (torch.randn(numel) * 1e-2).to(dtype)
    target = torch.empty(numel, dtype=dtype)
    stage = StageOptimizer("rate", master, lr=1e-3, weight_decay=0.1, backend=backend, target=target)

    def job() -> None:
        stage.new_iteration()
        stage.load_grads(grads)
        stage.apply(1e-3)

    try:
        with intra_op_threads(threads):
            seconds = time_op(job, torch.device("cpu"), repeat, fastest=True)
    finally:
        stage.close()
    return numel / max(seconds, 1e-9)
