"""One tiny Block's passes call by call, one thread (issue 27, point 3).

25 calls of the forward without autograd, then 25 of the recompute and backward, twice, at ``mbs``
sequences of 128 tokens; prints each call's ms with the fastest and the median. How far apart one
pass's calls lie is how far a fastest-of-3 timing can sit from what a run pays.

    PYTHONPATH=. OMP_NUM_THREADS=1 python profiling/results/cpu_2026-12-02_sixteenth/block_calls.py 8
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

from machine_drift import tiny_block_passes  # this folder: the script's own directory is on the path


def main() -> None:
    forward, backward = tiny_block_passes(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
    passes: list[tuple[str, Callable[[], None]]] = [("forward", forward), ("backward", backward)]
    for name, fn in passes * 2:
        ms = []
        for _ in range(25):
            t0 = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t0) * 1e3)
        print(name, " ".join(f"{t:.1f}" for t in ms), f"| fastest {min(ms):.1f} median {statistics.median(ms):.1f}")


if __name__ == "__main__":
    main()
