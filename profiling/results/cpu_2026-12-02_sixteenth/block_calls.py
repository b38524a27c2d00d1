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

import torch

from profiling.check_predictions import MODELS
from sysx.config import load_config, model_config
from sysx.model.llama import init_layer, make_layer


def main() -> None:
    torch.set_num_threads(1)
    mbs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    cfg = model_config(load_config([*MODELS["tiny"]]))
    layer = make_layer(cfg, 1)
    init_layer(layer, 1)
    x = torch.randn(mbs, 128, cfg.dim)

    def forward() -> None:
        with torch.no_grad():
            layer(x)

    def backward() -> None:
        inp = x.detach().requires_grad_(True)
        out = layer(inp)
        out.backward(torch.ones_like(out))

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
