"""The backward-memory probe's peaks at every token count the profile times (issue 27, point 3).

:func:`sysx.machine.host_cost._backward_peaks` for sub-stages of 1, 2 and 3 Blocks: once with every
token count in one process (ascending, as the profile runs it), once at 512 and 1024 tokens alone
(a fresh process each). Prints MiB.

    PYTHONPATH=. .venv/bin/python profiling/results/cpu_2026-12-02_seventeenth/backward_probe_points.py tiny
"""

import sys

import torch

from profiling.check_predictions import MODELS
from sysx.config import load_config, model_config
from sysx.machine.host_cost import _backward_peaks

MIB = 2**20
cfg = model_config(load_config([*MODELS[sys.argv[1] if len(sys.argv) > 1 else "tiny"]]))
tokens = [128, 256, 512, 1024, 2048]
for blocks in (1, 2, 3):
    together = _backward_peaks(cfg, 128, tokens, torch.float32, (blocks,), 120)[0]
    print(blocks, "Block(s), ascending in one process:", {t: round(v / MIB, 2) for t, v in together.items()})
    alone = {
        t: round(_backward_peaks(cfg, 128, [t], torch.float32, (blocks,), 120)[0][t] / MIB, 2) for t in (512, 1024)
    }
    print(blocks, "Block(s), each count in its own process:", alone)
