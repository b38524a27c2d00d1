"""Nineteenth session (issue 27, point 3): how much the tune-time measurements a tiny job's
prediction rests on move from one job start to the next, and which estimator moves least.

Spawns N gloo processes on this CPU (as a job's ranks) and repeats, TRIALS times, what
``schedule.tune`` measures at each start: the tiny-message p2p latency (sysx.autotune.p2p) and
the Block timed together with its meeting rounds (sysx.autotune.contention), with the current
settings and with the variants given. Rank 0 prints one row per trial and the spread (max/min).

    PYTHONPATH=. python profiling/results/cpu_2026-12-03_nineteenth/together_spread.py [N] [TRIALS]
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from sysx.autotune import contention, p2p
from sysx.model.config import get_preset
from sysx.optim.cores import intra_op_threads, rank_cores

SEQ = 128


def worker(rank: int, world: int, trials: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = get_preset("tiny")

    def meet(v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return float(t.item())

    rows = []
    for trial in range(trials):
        lat3 = p2p.measure_p2p(rank, world, world, torch.device("cpu"))
        saved = p2p.ROUNDS
        p2p.ROUNDS = 30
        lat30 = p2p.measure_p2p(rank, world, world, torch.device("cpu"))
        p2p.ROUNDS = saved
        with intra_op_threads(rank_cores(world)):
            now = contention.time_block_together(cfg, SEQ, torch.float32, barrier=tdist.barrier, meet=meet)
            long = contention.time_block_together(
                cfg, SEQ, torch.float32, barrier=tdist.barrier, meet=meet, windows=7, rounds=11
            )
        every: list = [None] * world
        tdist.all_gather_object(every, (now, long))
        if rank == 0:
            row = (
                lat3.intra_latency * 1e6,
                lat30.intra_latency * 1e6,
                statistics.fmean(e[0].wall for e in every) * 1e3,
                contention.meeting_seconds([e[0].rounds for e in every]) * 1e3,
                statistics.fmean(e[1].wall for e in every) * 1e3,
                contention.meeting_seconds([e[1].rounds for e in every]) * 1e3,
            )
            rows.append(row)
            print(f"trial {trial}: " + "  ".join(f"{x:8.2f}" for x in row), flush=True)
    if rank == 0:
        names = [
            "lat us (3)",
            "lat us (30)",
            "block ms (3 win)",
            "meet ms (5 rnd)",
            "block ms (7 win)",
            "meet ms (11 rnd)",
        ]
        for i, name in enumerate(names):
            col = [r[i] for r in rows]
            print(
                f"{name:18s} median {statistics.median(col):8.2f}  min {min(col):8.2f}  max {max(col):8.2f}  max/min {max(col) / max(min(col), 1e-9):.2f}"
            )
    tdist.destroy_process_group()


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    mp.spawn(worker, args=(n, trials, 29517), nprocs=n)
