"""What Capture and Replay cost one Block pass, beside the plain passes (issue 27, sixth session).

    PYTHONPATH=. .venv/bin/python profiling/results/cpu_2026-11-26_sixth/capture_overhead.py {tiny|50M} TOKENS

Median ms over 1 s of each (1 thread): forward without autograd, forward with autograd, run_captured
at level 0 and at the top level, a plain recompute + backward, backward_replayed at level 0 and at
the top level. Run it on two commits to compare them.
"""

import dataclasses
import statistics
import sys
import time

import torch

from sysx.model import PRESETS
from sysx.model.llama import init_layer, make_layer
from sysx.single.act_capture import backward_replayed, level_layouts, run_captured
from sysx.single.op_profile import profile_layer, run_layer


def median_ms(fn, span_s: float = 1.0, least: int = 5) -> float:
    fn()
    times: list[float] = []
    end = time.perf_counter() + span_s
    while time.perf_counter() < end or len(times) < least:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    cfg = PRESETS["tiny"]
    if sys.argv[1] == "50M":
        cfg = dataclasses.replace(cfg, dim=512, n_layers=16, n_heads=8, n_kv_heads=8, ffn_dim=1376)
    tokens, seq = int(sys.argv[2]), 128
    block = make_layer(cfg, 1)
    init_layer(block, 1)
    x = torch.randn(tokens // seq, seq, cfg.dim)
    g = torch.randn_like(x) * 1e-3
    profile = profile_layer(block, x, model_dim=cfg.dim)
    layouts = level_layouts(profile)
    top = len(layouts) - 1
    print(f"{len(profile.ops)} ops a forward; sites per level {[len(layout.sites) for layout in layouts]}")
    slot = torch.empty(max(layout.nbytes for layout in layouts), dtype=torch.uint8)

    def forward(grad: bool) -> None:
        with torch.set_grad_enabled(grad):
            run_layer(block, x.detach().requires_grad_(grad), None)

    def recompute_backward() -> None:
        with torch.enable_grad():
            torch.autograd.backward(run_layer(block, x.detach().requires_grad_(True), None), g)

    def replayed(level: int) -> float:
        run_captured(block, x, profile, layouts[level], slot)
        return median_ms(lambda: backward_replayed(block, g, profile, layouts[level], slot))

    row = {
        "fwd no_grad": median_ms(lambda: forward(False)),
        "fwd grad": median_ms(lambda: forward(True)),
        "run_captured L0": median_ms(lambda: run_captured(block, x, profile, layouts[0], slot)),
        f"run_captured L{top}": median_ms(lambda: run_captured(block, x, profile, layouts[top], slot)),
        "recompute+bwd": median_ms(recompute_backward),
        "backward_replayed L0": replayed(0),
        f"backward_replayed L{top}": replayed(top),
    }
    print(sys.argv[1], tokens, " | ".join(f"{k} {v:.3f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
