"""Sliding-window speed on a GPU: a 0.886B Llama shape with ``schedule=single`` (first GPU run, 2026-11-25).

``python3 profiling/gpu_window_speed.py PLACEMENT SEQUENCES STEPS`` prints one JSON line: the step
times, their median over steps 1.. (step 0 warms up), tokens/s, the window and the optimizer time no
compute hid per step. bf16, 2048 tokens, micro-batches of 4 sequences, ``single.device_memory_gb=12``
(so the window slides), DeepSpeed's CPU Adam (``optim.backend=auto``). Needs CUDA.
"""

from __future__ import annotations

import json
import statistics
import sys

from gpu_check import ONE_B

from sysx.config import load_config
from sysx.trainers.single import SingleTrainer


def main(argv: list[str]) -> int:
    """Run ``STEPS`` steps of ``SEQUENCES`` sequences per step at ``optim.placement=PLACEMENT``."""
    placement, sequences, steps = argv[0], int(argv[1]), int(argv[2])
    cfg = load_config(
        [
            "model=tiny",
            *ONE_B,
            "train.seq_len=2048",
            "train.micro_batch_size=4",
            f"train.micro_batches={sequences // 4}",
            f"train.steps={steps}",
            "eval.every=0",
            "device=cuda",
            "precision=bf16",
            "schedule=single",
            "single.device_memory_gb=12",
            f"optim.placement={placement}",
        ]
    )
    trainer = SingleTrainer(cfg)
    try:
        results = trainer.run(steps)
    finally:
        trainer.close()
    times = [r.step_time_s for r in results]
    median = statistics.median(times[1:])
    row = {
        "placement": placement,
        "sequences": sequences,
        "window": trainer.plan.window,
        "step_s": [round(t, 3) for t in times],
        "median_s": round(median, 3),
        "tokens_per_s": round(sequences * 2048 / median),
        "optimizer_exposed_s": [round(r.opt_exposed_s or 0.0, 3) for r in results],
    }
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
