"""The machine's own speed over time: a 256^3 matmul timed in consecutive windows (issue 27, twenty-first session).

python profiling/results/cpu_2026-12-03_twentyfirst/machine_jitter.py THREADS WINDOW_S TOTAL_S
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def rate(a: torch.Tensor, window_s: float) -> float:
    """Matmuls per second over one window."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < window_s:
        a @ a
        n += 1
    return n / (time.perf_counter() - t0)


def main(threads: int, window_s: float, total_s: float) -> None:
    torch.set_num_threads(threads)
    a = torch.randn(256, 256)
    rate(a, window_s)  # warm-up
    rs = [rate(a, window_s) for _ in range(int(total_s / window_s))]
    print(
        f"threads {threads}, {len(rs)} windows of {window_s:.2f} s: matmuls/s min {min(rs):.0f} "
        f"median {statistics.median(rs):.0f} max {max(rs):.0f}, max/min {max(rs) / min(rs):.2f}, "
        f"stdev/mean {100 * statistics.pstdev(rs) / statistics.mean(rs):.1f}%"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))
