"""Does another thread's OpenMP team slow the main thread's short parallel regions? (issue 27, twentieth session)

The main thread runs a tiny Block's forward and backward on two intra-op threads, 7 windows of 10,
and prints the median and fastest pass. MODE sets what another thread of the process holds:

- ``alone``: no other thread;
- ``teamidle``: a thread that never computes;
- ``team``: a thread that ran one parallel op on two threads (its own OpenMP team), then waits;
- ``team1``: the same on one thread (no team);
- ``main1``: no other thread, the main thread on one thread (what the second core adds).

    PYTHONPATH=. python profiling/results/cpu_2026-12-03_twentieth/omp_throttle.py MODE
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

from sysx.model import Block, get_preset

WINDOWS, PASSES = 7, 10


def main(mode: str) -> None:
    torch.set_num_threads(1 if mode == "main1" else 2)
    cfg = get_preset("tiny")
    block = Block(cfg)
    x = torch.randn(8, 128, cfg.dim, requires_grad=True)

    def one_pass() -> None:
        block(x).sum().backward()

    for _ in range(5):  # also fixes this thread's count before another thread sets torch's default
        one_pass()
    stop = threading.Event()

    def other() -> None:
        if mode in ("team", "team1"):
            torch.set_num_threads(2 if mode == "team" else 1)
            torch.randn(1 << 20).add_(1.0)  # a parallel op: two threads start this thread's team
        stop.wait()

    if mode.startswith("team"):
        threading.Thread(target=other, daemon=True).start()
        time.sleep(0.2)
    times = []
    for _ in range(WINDOWS):
        t0 = time.perf_counter()
        for _ in range(PASSES):
            one_pass()
        times.append((time.perf_counter() - t0) / PASSES)
    times.sort()
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"{mode:8s} OMP_WAIT_POLICY={policy:7s} median {times[WINDOWS // 2] * 1e3:.2f} ms  min {times[0] * 1e3:.2f}")
    stop.set()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # the waiting thread's OpenMP team would abort a normal interpreter exit
