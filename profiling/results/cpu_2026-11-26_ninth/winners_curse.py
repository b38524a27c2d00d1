"""Is the tuned winner's prediction biased low because the search picks it? (issue 27, point 3)

Measures N independent profiles of one job (fresh timings each, ``refresh``), lets each pick its
winner, and predicts every winner under its own profile and under the others. A winner picked for
its own profile's lucky timings would predict faster under its own profile than under the others
(others/own > 1). A middle-ranked candidate is the control.

    SYSX_CACHE_DIR=/tmp/curse PYTHONPATH=. OMP_NUM_THREADS=1 python \
        profiling/results/cpu_2026-11-26_ninth/winners_curse.py tiny 2 6
"""

from __future__ import annotations

import statistics
import sys

import torch

from profiling.check_predictions import MODELS
from sysx.autotune.apply import job_from_config
from sysx.autotune.cache import load_or_measure
from sysx.autotune.search import Budget, divisors, search
from sysx.config import load_config
from sysx.optim.cores import rank_cores

JOB = [  # check_predictions.py's pipeline rows
    "eval.every=0",
    "optim.backend=torch",
    "train.seq_len=128",
    "schedule=auto",
    "schedule.tune=true",
    "train.micro_batch_size=2",
    "train.micro_batches=8",
    "device=cpu",
]


def main() -> None:
    model, ranks, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cfg = load_config(MODELS[model] + JOB)
    job = job_from_config(cfg, ranks, ranks, torch.device("cpu"))
    results: list[dict[str, float]] = []
    for i in range(n):
        p, _ = load_or_measure(
            job.model,
            job.seq_len,
            divisors(job.global_batch),
            device=torch.device("cpu"),
            refresh=True,
            threads=rank_cores(ranks),
            adam_backend="torch",
        )
        ms = [(t.tokens, round(t.fwd_s * 1e3, 2), round(t.bwd_s * 1e3, 2)) for t in p.layers["block"]]
        print(f"profile {i}: Block (tokens, forward ms, backward ms): {ms}", flush=True)
        budget = Budget(gpu=float(p.hardware.device_free_bytes), host=float(p.host_available), shm=float(p.shm_free))
        results.append({c.label(): c.iteration for c in search(job, budget, p).fitting})
    ratios = []
    for i, r in enumerate(results):
        win = min(r, key=lambda k: r[k])
        others = statistics.fmean(results[j][win] for j in range(n) if j != i and win in results[j])
        ratios.append(others / r[win])
        print(
            f"profile {i}: winner {win}: own {r[win] * 1e3:.1f} ms, others' {others * 1e3:.1f} ms ({ratios[-1]:.3f}x)"
        )
    print(f"winners, others/own on average: {statistics.fmean(ratios):.3f}")
    common = [k for k in results[0] if all(k in r for r in results)]
    mid = sorted(common, key=lambda k: results[0][k])[len(common) // 2]
    ctrl = [statistics.fmean(results[j][mid] for j in range(n) if j != i) / results[i][mid] for i in range(n)]
    print(f"control {mid}: others/own on average: {statistics.fmean(ctrl):.3f}")


if __name__ == "__main__":
    main()
