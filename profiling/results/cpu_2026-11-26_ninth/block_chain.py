"""k Blocks in a chain against k times one Block, one intra-op thread (issue 27, point 3).

The median over 1 s of the forward (no autograd) and of the backward with its recompute (forward
with autograd, then backward) of 1, 2 and 4 Blocks in a row, at ``train.seq_len=128`` and ``mbs``
sequences; the 2- and 4-Block times are printed over k times the 1-Block time.

    PYTHONPATH=. OMP_NUM_THREADS=1 python profiling/results/cpu_2026-11-26_ninth/block_chain.py tiny 8
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from profile_vs_composed import median_ms  # this folder: the script's own directory is on the path

from profiling.check_predictions import MODELS
from sysx.config import load_config, model_config
from sysx.model.llama import init_layer, make_layer


def main() -> None:
    torch.set_num_threads(1)
    model, mbs = sys.argv[1], int(sys.argv[2])
    cfg = model_config(load_config([*MODELS[model], "train.seq_len=128"]))
    blocks = []
    for i in range(1, 5):
        block = make_layer(cfg, i)
        init_layer(block, i)
        blocks.append(block)
    x = torch.randn(mbs, 128, cfg.dim, generator=torch.Generator().manual_seed(0))

    def forward(k: int) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                h = x
                for b in blocks[:k]:
                    h = b(h)

        return run

    def backward(k: int) -> Callable[[], None]:
        def run() -> None:
            h = x.detach().requires_grad_(True)
            for b in blocks[:k]:
                h = b(h)
            h.backward(torch.ones_like(h))

        return run

    one_f, one_b = median_ms(forward(1)), median_ms(backward(1))
    print(f"{model}, {mbs} x 128 tokens: 1 Block forward {one_f:.2f} ms, backward {one_b:.2f} ms")
    for k in (2, 4):
        f, b = median_ms(forward(k)) / (k * one_f), median_ms(backward(k)) / (k * one_b)
        print(f"  {k} Blocks: forward {f:.3f}x, backward {b:.3f}x k x 1 Block")


if __name__ == "__main__":
    main()
