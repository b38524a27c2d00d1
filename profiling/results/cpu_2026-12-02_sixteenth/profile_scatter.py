"""The tiny model's Block in ``n`` fresh profiles, back to back (issue 27, point 3).

Each line: the profile's forward / backward ms of the Block at 1-16 sequences of 128 tokens, the
forward + backward per sequence, and the Head at 8 sequences; one intra-op thread, as a rank of a
2-rank job on 2 cores is profiled. Run it at two commits to compare ways of timing.

    PYTHONPATH=. OMP_NUM_THREADS=1 python profiling/results/cpu_2026-12-02_sixteenth/profile_scatter.py 4
"""

from __future__ import annotations

import sys
import time

from profiling.check_predictions import MODELS
from sysx.autotune.profile import measure_profile
from sysx.config import load_config, model_config
from sysx.optim.cores import intra_op_threads


def main() -> None:
    cfg = model_config(load_config([*MODELS["tiny"]]))
    hardware = None
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
        t0 = time.perf_counter()
        with intra_op_threads(1):
            p = measure_profile(cfg, 128, [1, 2, 4, 8, 16], hardware=hardware, adam_backend="torch")
        hardware = p.hardware
        block = p.layers["block"]
        passes = " ".join(f"{q.tokens // 128}:{q.fwd_s * 1e3:.1f}/{q.bwd_s * 1e3:.1f}" for q in block)
        per_seq = " ".join(f"{(q.fwd_s + q.bwd_s) * 1e3 / (q.tokens / 128):.2f}" for q in block)
        head = next(q for q in p.layers["head"] if q.tokens == 1024)
        print(
            f"{time.perf_counter() - t0:.0f} s | Block fwd/bwd ms by sequences: {passes} | ms a sequence: {per_seq} "
            f"| Head at 8: {head.fwd_s * 1e3:.1f}/{head.bwd_s * 1e3:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
