"""One CPU Adam thread's rate (parameters stepped per second) on this machine: what the pipeline's
optimizer placement and the single-GPU lanes weigh the CPU lane by; and the rate of a whole
optimizer job (gradients loaded and checked, the step, the working copy written), what a pipeline
plan charges for each job (the autotune profile).

Both are timed with the caches cold, as a job meets its unit in training: between two jobs of one
unit a step streams its activations, weights and the other units' states through the caches, so
the unit's master, moments and gradients come from memory. Timed back to back on the same tensors
the step ran 2x faster than in the job (issue 27: a 0.2M-parameter job, validating first, loaded in
0.18 ms and stepped in 0.48-0.53 ms warm, 0.33-0.36 and 1.01-1.07 ms after 64 MiB were streamed,
0.33-0.40 and 1.2-1.7 ms in a tiny 2-replica job; Intel Xeon VM, whose 480 MiB L3 held the warm
tensors even at 1M parameters)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from sysx.optim.cores import intra_op_threads
from sysx.optim.cpu_adam import CpuAdam
from sysx.optim.stage import StageOptimizer

# bytes streamed through the caches before each timed run: a step moves far more between two jobs of
# a unit (a tiny model's 0.14 s step, ~1 GB), and 64 MiB already gave the job's own times (above)
EVICT_BYTES = 64 << 20


def evict_caches(buffer: torch.Tensor) -> None:
    """Stream ``buffer`` through the caches (read and written): what was cached before is gone."""
    buffer.add_(1)


def fastest_cold(fn: Callable[[], object], repeat: int, *, evict_bytes: int = EVICT_BYTES) -> float:
    """Seconds of ``fn``: the fastest of ``repeat`` runs after a warm-up, each run timed after
    :func:`evict_caches` streamed ``evict_bytes`` (not timed). The fastest, because on a shared CPU
    the slow runs are other processes' time slices; cold, because a job's state is cold in training."""
    buffer = torch.zeros(max(1, evict_bytes), dtype=torch.uint8)
    fn()  # warm up: the first calls allocate
    best = float("inf")
    for _ in range(max(1, repeat)):
        evict_caches(buffer)
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def adam_params_per_s(numel: int = 1 << 20, *, threads: int = 1, backend: str = "auto", repeat: int = 3) -> float:
    """CPU Adam throughput (parameters stepped per second) of one optimizer with ``threads`` intra-op
    threads: the fastest of ``repeat`` steps after a warm-up, each with the caches cold."""
    p = torch.randn(numel) * 0.02
    g = torch.randn(numel) * 1e-2
    opt = CpuAdam(p, lr=1e-3, weight_decay=0.1, backend=backend)
    try:
        with intra_op_threads(threads):
            seconds = fastest_cold(lambda: opt.step(g), repeat)
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
    written (:func:`sysx.optim.threads._step_job`'s work); the fastest of ``repeat`` after a warm-up,
    each with the caches cold. Warm, 2.4-2.5x the Adam step's time alone on a 16-bit job on the Xeon
    VM (profiling/RESULTS.md)."""
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
            seconds = fastest_cold(job, repeat)
    finally:
        stage.close()
    return numel / max(seconds, 1e-9)
