"""The profile's Block time against a window of the same Block alone, at 1 and 8 sequences (issue 27, point 3).

:func:`sysx.autotune.contention.slowdown` divides the ranks' windowed time of the Block at one
sequence by the profile's (fastest of 3) and charges that factor, at least 1, at every token count.
This measures a profile (:func:`sysx.autotune.profile.measure_profile`, tiny, one intra-op thread),
then the same Block alone the way the contention probe times it (the median of 3 windows of 0.3 s,
:func:`~sysx.autotune.contention.mean_run_seconds`), at 1 and 8 sequences of 128 tokens.

    PYTHONPATH=. OMP_NUM_THREADS=1 python profiling/results/cpu_2026-11-26_ninth/profile_vs_window.py
"""

from __future__ import annotations

import statistics

import torch

from sysx.autotune.contention import mean_run_seconds
from sysx.autotune.profile import measure_profile
from sysx.config import load_config, model_config
from sysx.model.llama import init_layer, make_layer

SEQ = 128


def main() -> None:
    torch.set_num_threads(1)
    cfg = model_config(load_config(["model=tiny", f"train.seq_len={SEQ}"]))
    profile = measure_profile(cfg, SEQ, [1, 2, 4, 8, 16], adam_backend="torch")
    block = make_layer(cfg, 1)
    init_layer(block, 1)
    for mbs in (1, 8):
        x = torch.randn(mbs, SEQ, cfg.dim)

        def step(x: torch.Tensor = x) -> None:
            h = x.detach().requires_grad_(True)
            y = block(h)
            y.backward(torch.ones_like(y))
            with torch.no_grad():
                block(x)

        fwd, bwd = profile.layer_time("block", mbs * SEQ)
        window = statistics.median(mean_run_seconds(step, repeats=7, window_s=0.3)[0] for _ in range(3))
        print(
            f"{mbs} x {SEQ} tokens: profile forward + backward {(fwd + bwd) * 1e3:.2f} ms, "
            f"windowed alone {window * 1e3:.2f} ms, {window / (fwd + bwd):.3f}x"
        )


if __name__ == "__main__":
    main()
