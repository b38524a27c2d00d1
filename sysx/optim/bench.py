"""Optimizer benchmark: ``python -m sysx.optim.bench [--sizes 10M,50M,100M] [--threads 1,2]``.

Prints four markdown tables: step throughput per backend, buffer size and thread count; rollback
cost; undo error; and a simulated pipeline of sub-stages, synchronous vs asynchronous optimizer.
``sysx bench optim [--size 50M] [--json]`` is the short one: a step under each rollback mode
(:mod:`sysx.optim.bench_modes`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from sysx.optim.cores import intra_op_threads
from sysx.optim.cpu_adam import CpuAdam

BYTES_PER_ELEM = 28

REGIMES: dict[str, dict[str, float]] = {
    # name: lr, weight_decay, beta1, beta2, gradient scale, warm-up steps, spike factor of the undone step
    "typical": dict(lr=1e-3, wd=0.1, b1=0.9, b2=0.999, gs=1e-2, warm=10, spike=1.0),
    "first step": dict(lr=1e-3, wd=0.1, b1=0.9, b2=0.999, gs=1e-2, warm=0, spike=1.0),
    "large lr": dict(lr=1e-1, wd=0.1, b1=0.9, b2=0.999, gs=1e-2, warm=10, spike=1.0),
    "tiny grads": dict(lr=1e-3, wd=0.0, b1=0.9, b2=0.999, gs=1e-10, warm=10, spike=1.0),
    "grad spike x1000": dict(lr=1e-3, wd=0.1, b1=0.9, b2=0.999, gs=1e-2, warm=10, spike=1e3),
    "betas 0.8/0.95": dict(lr=1e-3, wd=0.1, b1=0.8, b2=0.95, gs=1e-2, warm=10, spike=1.0),
}


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The fp32 unit in the last place of ``|x|`` (the spacing to the next larger float)."""
    a = x.abs().float().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.nextafter(a, torch.full_like(a, math.inf)) - a


@dataclass(frozen=True)
class UndoError:
    """Error of one tensor after step + undo."""

    max_abs: float
    exact_share: float  # share of elements restored bit for bit
    max_ulps: float  # max |after undo - before| / ulp(max(|before|, |after step|))


def measure_undo_error(backend: str, regime: str, *, n: int = 100_003, seed: int = 0) -> dict[str, UndoError]:
    """Step then undo once after the regime's warm-up; the error of p, m and v."""
    r = REGIMES[regime]
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen) * 0.02
    opt = CpuAdam(p, lr=r["lr"], betas=(r["b1"], r["b2"]), weight_decay=r["wd"], backend=backend)
    try:
        for _ in range(int(r["warm"])):
            opt.step(torch.randn(n, generator=gen) * r["gs"])
        before = [p.clone(), opt.exp_avg.clone(), opt.exp_avg_sq.clone()]
        g = torch.randn(n, generator=gen) * (r["gs"] * r["spike"])
        opt.step(g)
        after = [p.clone(), opt.exp_avg.clone(), opt.exp_avg_sq.clone()]
        opt.undo(g)
        restored = [p, opt.exp_avg, opt.exp_avg_sq]
    finally:
        opt.close()
    out = {}
    for name, b, a, x in zip("pmv", before, after, restored):
        d = (x - b).abs()
        out[name] = UndoError(
            max_abs=float(d.max()),
            exact_share=float((d == 0).double().mean()),
            max_ulps=float((d / ulp(torch.maximum(b.abs(), a.abs()))).max()),
        )
    return out


def _time(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm-up (page faults, first-touch)
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _with_threads(n: int, fn: Callable[[], float]) -> float:
    with intra_op_threads(n):
        return fn()


def bench_steps(sizes: list[int], threads: list[int], repeat: int) -> list[tuple[str, int, int, float]]:
    """``(backend, size, threads, seconds per step)`` rows."""
    rows = []
    for n in sizes:
        p = torch.randn(n) * 0.02
        g = torch.randn(n) * 1e-2
        for t in threads:
            for backend in ("deepspeed", "torch"):
                opt = CpuAdam(p, lr=1e-3, weight_decay=0.1, backend=backend)
                rows.append((backend, n, t, _with_threads(t, partial(_time, partial(opt.step, g), repeat))))
                opt.close()
            q = torch.nn.Parameter(p.clone())
            q.grad = g.clone()
            ref = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.1, fused=True)
            rows.append(("torch AdamW fused", n, t, _with_threads(t, partial(_time, ref.step, repeat))))
    return rows


def bench_rollback(sizes: list[int], repeat: int, threads: int) -> list[tuple[str, int, float, float, float]]:
    """``(backend, size, step s, undo s, snapshot-mode step s)`` rows, with ``threads`` intra-op threads."""
    with intra_op_threads(threads):
        return _bench_rollback(sizes, repeat)


def _bench_rollback(sizes: list[int], repeat: int) -> list[tuple[str, int, float, float, float]]:
    rows = []
    for n in sizes:
        p = torch.randn(n) * 0.02
        g = torch.randn(n) * 1e-2
        for backend in ("deepspeed", "torch"):
            opt = CpuAdam(p, lr=1e-3, weight_decay=0.1, backend=backend)
            step_s = _time(partial(opt.step, g), repeat)
            undo_s = min(_step_then_undo(opt, g) for _ in range(repeat))
            opt.close()
            snap = CpuAdam(p, lr=1e-3, weight_decay=0.1, backend=backend, rollback="snapshot")
            snap_s = _time(partial(snap.step, g), repeat)
            snap.close()
            rows.append((backend, n, step_s, undo_s, snap_s))
    return rows


def _step_then_undo(opt: CpuAdam, g: torch.Tensor) -> float:
    """One step, then the seconds of its undo."""
    opt.step(g)
    t0 = time.perf_counter()
    opt.undo(g)
    return time.perf_counter() - t0


def bench_pipeline(
    n_stages: int, numel: int, backward_s: float, backend: str, workers: int, threads_per_worker: int
) -> dict[str, float]:
    """Exposed optimizer time after the last sub-stage's gradients, sync vs async (seconds)."""
    from sysx.optim.loss_scaler import make_scaler
    from sysx.optim.stage import StageOptimizer
    from sysx.optim.threads import OptimizerThreads
    from sysx.optim.validation import post_step_validate, sync_step

    grads = {f"s{i}": (torch.randn(numel) * 1e-2).bfloat16() for i in range(n_stages)}
    out: dict[str, float] = {}
    for mode in ("sync", "async"):
        stages = [
            StageOptimizer(
                name,
                torch.randn(numel) * 0.02,
                lr=1e-3,
                backend=backend,
                target=torch.empty(numel, dtype=torch.bfloat16),
            )
            for name in grads
        ]
        scaler = make_scaler("bf16")
        with OptimizerThreads(stages, workers=workers, threads_per_worker=threads_per_worker) as threads:
            for _ in range(2):  # the first iteration warms up the buffers
                t_last = 0.0
                for name, g in grads.items():
                    time.sleep(backward_s)
                    t_last = time.perf_counter()
                    if mode == "async":
                        threads.submit_step(name, g, None, lr=1e-3)
                if mode == "async":
                    post_step_validate(threads.wait(), threads, scaler, lr=1e-3)
                else:
                    sync_step(grads, threads, scaler, lr=1e-3)
                out[mode] = time.perf_counter() - t_last
        for s in stages:
            s.close()
    return out


def _parse_sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        mult = 1_000_000 if part.endswith("M") else 1_000 if part.endswith("K") else 1
        out.append(int(float(part.rstrip("MK")) * mult))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and print markdown tables; ``optim ...`` runs :mod:`sysx.optim.bench_modes`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["optim"]:  # `sysx bench optim --size 50M --json`: the rollback modes' step times
        from sysx.optim.bench_modes import main as bench_modes

        return bench_modes(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m sysx.optim.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10M,50M,100M", help="buffer sizes, e.g. 10M,50M")
    ap.add_argument("--threads", default="1,2", help="intra-op thread counts to try")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions (best is reported)")
    ap.add_argument("--stages", type=int, default=6, help="simulated pipeline: sub-stages")
    ap.add_argument("--stage-size", default="10M", help="simulated pipeline: elements per sub-stage")
    ap.add_argument("--backward-ms", type=float, default=60.0, help="simulated pipeline: backward time per sub-stage")
    ap.add_argument(
        "--opt-threads", type=int, default=1, help="intra-op threads per optimizer worker (rollback, pipeline)"
    )
    ap.add_argument("--skip", default="", help="comma list of tables to skip: steps,rollback,undo,pipeline")
    args = ap.parse_args(argv)
    sizes, threads = _parse_sizes(args.sizes), [int(t) for t in args.threads.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    print(f"# sysx optimizer benchmark  (torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()})\n")
    if "steps" not in skip:
        print("| backend | elements | threads | ms/step | Melem/s | GB/s |\n|---|---:|---:|---:|---:|---:|")
        for backend, n, t, s in bench_steps(sizes, threads, args.repeat):
            print(
                f"| {backend} | {n / 1e6:.0f}M | {t} | {s * 1e3:.1f} | {n / s / 1e6:.0f} | {n * BYTES_PER_ELEM / s / 1e9:.1f} |"
            )
        print()
    if "rollback" not in skip:
        print(f"Rollback, {args.opt_threads} thread(s)\n")
        print("| backend | elements | step ms | undo ms | snapshot-mode step ms (overhead) | snapshot memory |")
        print("|---|---:|---:|---:|---:|---:|")
        for backend, n, st, un, sn in bench_rollback(sizes, args.repeat, args.opt_threads):
            print(
                f"| {backend} | {n / 1e6:.0f}M | {st * 1e3:.1f} | {un * 1e3:.1f} | {sn * 1e3:.1f} (+{(sn - st) * 1e3:.1f}) "
                f"| {12 * n / 2**20:.0f} MiB |"
            )
        print()
    if "undo" not in skip:
        print(
            "| backend | regime | p: max abs / exact / max ulps | m: max abs / exact / max ulps | v: max abs / exact / max ulps |"
        )
        print("|---|---|---|---|---|")
        for backend in ("deepspeed", "torch"):
            for regime in REGIMES:
                e = measure_undo_error(backend, regime)
                cells = [f"{e[k].max_abs:.2e} / {e[k].exact_share * 100:.1f}% / {e[k].max_ulps:.2f}" for k in "pmv"]
                print(f"| {backend} | {regime} | " + " | ".join(cells) + " |")
        print()
    if "pipeline" not in skip:
        numel = _parse_sizes(args.stage_size)[0]
        print(
            f"Simulated pipeline: {args.stages} sub-stages x {numel / 1e6:.0f}M elements, backward "
            f"{args.backward_ms:.0f} ms each, bf16 grads, {args.opt_threads} thread(s) per worker; time from the last "
            "gradient hand-over to the last step done\n"
        )
        print("| backend | workers | sync ms | async ms |\n|---|---:|---:|---:|")
        for backend, workers in (("deepspeed", 1), ("torch", 1), ("torch", 2)):
            r = bench_pipeline(args.stages, numel, args.backward_ms / 1e3, backend, workers, args.opt_threads)
            print(f"| {backend} | {workers} | {r['sync'] * 1e3:.0f} | {r['async'] * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
