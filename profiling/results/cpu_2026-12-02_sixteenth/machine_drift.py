"""How much this machine's speed drifts: one tiny Block at 8 sequences, one thread (issue 27, point 3).

A fixed piece of work (the Block's forward without autograd, then its recompute and backward, as a
pipeline rank runs it) timed in back-to-back windows of 0.5 s for ``seconds`` seconds; prints every
window's mean in ms, then the spread of the means over 0.5, 2 and 5 s. Whatever a profile and a run
measure at different moments differs by at least this much.

    PYTHONPATH=. OMP_NUM_THREADS=1 python profiling/results/cpu_2026-12-02_sixteenth/machine_drift.py 60
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

from profiling.check_predictions import MODELS
from sysx.config import load_config, model_config
from sysx.machine.hardware import mean_run_seconds
from sysx.model.llama import init_layer, make_layer


def tiny_block_passes(mbs: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """One tiny Block's forward without autograd and its recompute and backward, as a pipeline rank
    runs them, on ``mbs`` sequences of 128 tokens, with one intra-op thread."""
    torch.set_num_threads(1)
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

    return forward, backward


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    forward, backward = tiny_block_passes(8)

    def step() -> None:
        forward()
        backward()

    step()
    windows: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        windows.append(mean_run_seconds(step, repeats=1, window_s=0.5)[0] * 1e3)
    print("0.5-s windows, ms:", " ".join(f"{w:.0f}" for w in windows))
    for k in (1, 4, 10):
        means = [statistics.fmean(windows[i : i + k]) for i in range(0, len(windows) - k + 1, k)]
        if len(means) < 2:  # too short a run for this span
            continue
        print(
            f"{k * 0.5:.1f}-s means: {min(means):.1f}-{max(means):.1f} ms, max/min {max(means) / min(means):.2f}, "
            f"sd/mean {statistics.pstdev(means) / statistics.fmean(means):.3f}"
        )


if __name__ == "__main__":
    main()
