"""One Block's forward and backward, ms (median over 1 s each, 1 thread): the graph kept by the
allocator (a plain autograd forward, its backward later), the graph kept with its saved tensors
packed into the slot (``run_keeping_graph`` / ``backward_kept``), and sites captured at level 4
and replayed (``run_captured`` / ``backward_replayed``), with each slot's bytes.

    PYTHONPATH=. .venv/bin/python profiling/results/cpu_2026-11-26_seventh/kept_graph_passes.py tiny 1024
    PYTHONPATH=. .venv/bin/python profiling/results/cpu_2026-11-26_seventh/kept_graph_passes.py 50M 2048
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from sysx.model import get_preset
from sysx.model.llama import init_layer, make_layer
from sysx.single.act_capture import (
    backward_kept,
    backward_replayed,
    kept_graph_layout,
    level_layouts,
    run_captured,
    run_keeping_graph,
)
from sysx.single.op_profile import profile_layer


def median_ms(fn, span_s: float = 1.0) -> float:
    fn()
    times = []
    t_end = time.perf_counter() + span_s
    while time.perf_counter() < t_end or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    name, tokens = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    cfg = get_preset("tiny")
    if name == "50M":
        cfg = dataclasses.replace(cfg, dim=512, n_layers=16, n_heads=8, n_kv_heads=8, ffn_dim=1376)
    block = make_layer(cfg, 1)
    init_layer(block, 1)
    x = torch.randn(tokens // 128, 128, cfg.dim)
    g = torch.randn_like(x) * 1e-3
    profile = profile_layer(block, x, model_dim=cfg.dim, count_graph=True)
    top = level_layouts(profile)[-1]
    kept = kept_graph_layout(profile)
    slot_top = torch.empty(top.nbytes, dtype=torch.uint8)
    slot_kept = torch.empty(kept.nbytes, dtype=torch.uint8)
    out = torch.empty_like(x)

    def plain_fwd():
        xin = x.detach().requires_grad_(True)
        with torch.enable_grad():
            return xin, block(xin)

    def plain_both():
        _, y = plain_fwd()
        y.backward(g)

    rows = {
        "allocator graph: forward": median_ms(plain_fwd),
        "allocator graph: forward + backward": median_ms(plain_both),
        "packed graph: forward": median_ms(lambda: run_keeping_graph(block, x, kept, slot_kept, out=out)),
        "packed graph: forward + backward": median_ms(
            lambda: backward_kept(run_keeping_graph(block, x, kept, slot_kept, out=out), g)
        ),
        "level 4: forward (capture)": median_ms(lambda: run_captured(block, x, profile, top, slot_top)),
        "level 4: forward + backward (replay)": median_ms(
            lambda: (
                run_captured(block, x, profile, top, slot_top),
                backward_replayed(block, g, profile, top, slot_top),
            )
        ),
    }
    print(f"{name}, {tokens} tokens: slot at level 4 {top.nbytes / 2**20:.2f} MiB, kept {kept.nbytes / 2**20:.2f} MiB")
    for k, v in rows.items():
        print(f"  {k:<40} {v:8.2f} ms")


if __name__ == "__main__":
    main()
