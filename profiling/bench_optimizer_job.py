"""What one CPU optimizer job costs beyond its Adam step, with the gradient norm taken two ways.

A job (:func:`sysx.optim.threads._step_job`) loads the 16-bit gradients into fp32 and takes their
norm, steps Adam and writes the 16-bit working copy. The norm was one fp64 norm per 256K chunk; it
is now fp32 norms of rows of 1024 whose squares add in fp64 (:func:`sysx.optim.stage.chunk_square`).
Both variants and Adam alone run interleaved, round after round, on one thread; the table gives the
fastest round of each in ns per parameter, and the ratios::

    PYTHONPATH=. .venv/bin/python profiling/bench_optimizer_job.py [--sizes 400K,1M,4M] [--rounds 7]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from sysx.optim import stage as stage_mod
from sysx.optim.stage import StageOptimizer


def fp64_chunk_square(g: torch.Tensor) -> float:
    """The norm as it was: one fp64 norm of the chunk."""
    return float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2


def _size(text: str) -> int:
    scale = {"K": 1_000, "M": 1_000_000}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _fastest(fn: Callable[[], None], rounds: list[float]) -> None:
    t0 = time.perf_counter()
    fn()
    rounds.append(time.perf_counter() - t0)


def measure(numel: int, n_rounds: int) -> dict[str, float]:
    """ns per parameter of Adam alone, the job's load with either norm, and the whole job with each."""
    grads = (torch.randn(numel) * 1e-2).to(torch.bfloat16)
    stage = StageOptimizer(
        "bench", torch.randn(numel) * 0.02, lr=1e-3, weight_decay=0.1, target=torch.empty(numel, dtype=torch.bfloat16)
    )
    rows = stage_mod.chunk_square

    def job() -> None:
        stage.new_iteration()
        stage.load_grads(grads)
        stage.apply(1e-3)

    def with_norm(norm: Callable[[torch.Tensor], float], fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            stage_mod.chunk_square = norm
            try:
                fn()
            finally:
                stage_mod.chunk_square = rows

        return run

    variants = {
        "adam step": lambda: stage.optimizer.step(stage._grads(), lr=1e-3),
        "load, fp64 norm": with_norm(fp64_chunk_square, lambda: stage.load_grads(grads)),
        "load, fp32 rows": with_norm(rows, lambda: stage.load_grads(grads)),
        "job, fp64 norm": with_norm(fp64_chunk_square, job),
        "job, fp32 rows": with_norm(rows, job),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for fn in variants.values():
            fn()  # warm up
        for _ in range(n_rounds):
            for name, fn in variants.items():
                _fastest(fn, times[name])
    finally:
        stage.close()
    return {k: min(v) * 1e9 / numel for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="400K,1M,4M", help="parameters per job, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cols = ["adam step", "load, fp64 norm", "load, fp32 rows", "job, fp64 norm", "job, fp32 rows"]
    print(f"ns per parameter, fastest of {args.rounds} interleaved rounds, 1 thread, bf16 gradients and target")
    print("| params | " + " | ".join(cols) + " | job fp64 / fp32 rows | job / Adam (rows) |")
    print("|---" * (len(cols) + 3) + "|")
    for text in args.sizes.split(","):
        r = measure(_size(text), args.rounds)
        cells = " | ".join(f"{r[c]:.2f}" for c in cols)
        ratio = r["job, fp64 norm"] / r["job, fp32 rows"]
        print(f"| {text} | {cells} | {ratio:.2f}x | {r['job, fp32 rows'] / r['adam step']:.2f}x |")


if __name__ == "__main__":
    main()
