"""Does running beside another rank slow a tiny Block more at larger micro-batches? (issue 27, point 3)

Two processes, one intra-op thread each, time a tiny Block's no-grad forward and its recompute and
backward at 1, 2, 4 and 8 sequences of 128 tokens: for each size, 1.5 s with only the first process
computing ("alone"), then 1.5 s with both ("together"), 3 cycles, so the machine's drift falls on
both alike. Prints per size the mean ms alone and together and each cycle's ratio.

    PYTHONPATH=. .venv/bin/python profiling/results/cpu_2026-12-02_seventeenth/contention_by_size.py [128|512]
"""

import multiprocessing as mp
import statistics
import sys
import time

PHASE_S = 1.5
SIZES = [1, 2, 4, 8]
CYCLES = 3


def worker(rank: int, barrier, results, dim: int) -> None:
    import torch

    from profiling.check_predictions import MODELS
    from sysx.config import load_config, model_config
    from sysx.model.llama import init_layer, make_layer

    torch.set_num_threads(1)
    cfg = model_config(load_config(MODELS["tiny"] if dim == 128 else MODELS["50M"]))
    layer = make_layer(cfg, 1)
    init_layer(layer, 1)
    xs = {m: torch.randn(m, 128, cfg.dim) for m in SIZES}

    def step(x: torch.Tensor) -> None:
        with torch.no_grad():
            layer(x)
        inp = x.detach().requires_grad_(True)
        out = layer(inp)
        out.backward(torch.ones_like(out))

    for x in xs.values():
        step(x)
    for cycle in range(CYCLES):
        for m in SIZES:
            for mode in ("alone", "together"):
                barrier.wait()
                if mode == "alone" and rank == 1:
                    time.sleep(PHASE_S)
                    continue
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < PHASE_S:
                    step(xs[m])
                    n += 1
                results.put((cycle, m, mode, (time.perf_counter() - t0) / n))


def main() -> None:
    dim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, barrier, results, dim)) for r in range(2)]
    for p in procs:
        p.start()
    rows = [results.get() for _ in range(CYCLES * len(SIZES) * 3)]  # alone: 1 row, together: 2
    for p in procs:
        p.join()
    for m in SIZES:
        alone = {c: t for c, mm, mode, t in rows if mm == m and mode == "alone"}
        together = {
            c: statistics.fmean(t for cc, mm, mode, t in rows if mm == m and mode == "together" and cc == c)
            for c in alone
        }
        ratios = " ".join(f"{together[c] / alone[c]:.2f}" for c in sorted(alone))
        print(
            f"{m} sequences: alone {statistics.fmean(alone.values()) * 1e3:.2f} ms, together "
            f"{statistics.fmean(together.values()) * 1e3:.2f} ms, ratio per cycle {ratios}"
        )


if __name__ == "__main__":
    main()
