"""Nineteenth session (issue 27, point 3): the backward probe's raw peaks (MiB) for sub-stages of 1,
2 and 4 tiny Blocks, three fresh processes each: the counts taken one per process, and ascending
in one process as the profiler takes them.

    PYTHONPATH=. python profiling/results/cpu_2026-12-03_nineteenth/block_peaks.py
"""

from __future__ import annotations

import torch

from sysx.machine.host_cost import _backward_peaks
from sysx.model.config import get_preset

cfg = get_preset("tiny")
for toks in ([512], [1024], [128, 256, 512, 1024, 2048]):
    for blocks in (1, 2, 4):
        runs = [_backward_peaks(cfg, 128, toks, torch.float32, (blocks,), 120.0)[0] for _ in range(3)]
        print(toks, blocks, [{t: round(v / 2**20, 2) for t, v in r.items()} for r in runs], flush=True)
