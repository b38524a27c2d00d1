"""Nineteenth session (issue 27, point 3): the backward-memory probe, the old way (the fewest and
the most tokens, one Block against two) beside the new (every count up to the cap, one Block
against four), on tiny and the check's ~50M model: the probe's wall time and its (per Block,
once) MiB at each count. Run it twice to see the scatter between probes.

    PYTHONPATH=. python profiling/results/cpu_2026-12-03_nineteenth/backward_probe.py
"""

from __future__ import annotations

import dataclasses
import time

import torch

from sysx.autotune.profile import backward_probe_tokens
from sysx.machine.host_cost import measure_backward_bytes
from sysx.model.config import get_preset

MIB = 2**20

tiny = get_preset("tiny")
m50 = dataclasses.replace(tiny, dim=512, n_layers=16, n_heads=8, n_kv_heads=8, ffn_dim=1376)
counts = [128 * m for m in (1, 2, 4, 8, 16)]  # the check's micro-batch sizes at 128 tokens
for name, cfg in (("tiny", tiny), ("50M", m50)):
    for label, toks, blocks in (
        ("old: the ends, 1 vs 2 Blocks", [counts[0], counts[-1]], 2),
        ("new: every count, 1 vs 4 Blocks", backward_probe_tokens(counts), 4),
    ):
        t0 = time.perf_counter()
        got = measure_backward_bytes(cfg, 128, toks, torch.float32, blocks=blocks)
        points = ", ".join(f"{t}: {a / MIB:.2f}/{b / MIB:.2f}" for t, (a, b) in got.items())
        print(f"{name} {label}: {time.perf_counter() - t0:.1f} s; {points}", flush=True)
