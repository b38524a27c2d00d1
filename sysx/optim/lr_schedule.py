"""The learning-rate schedule shared by every trainer: linear warmup, then cosine decay."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr: float) -> float:
    """The learning rate of 0-based optimizer step ``step``.

    Warmup: ``(step + 1) / warmup_steps * lr`` for ``step < warmup_steps``. After that a cosine
    from ``lr`` (at ``step == warmup_steps``) down to ``min_lr`` (at ``step == total_steps``);
    steps past ``total_steps`` stay at ``min_lr``. Raises ValueError naming a bad argument.
    """
    if step < 0:
        raise ValueError(f"lr_at: step={step} is negative; steps are 0-based")
    if lr < 0 or min_lr < 0:
        raise ValueError(f"lr_at: lr={lr} and min_lr={min_lr} must be >= 0")
    if min_lr > lr:
        raise ValueError(f"lr_at: min_lr={min_lr} is above lr={lr}; set optim.min_lr <= optim.lr")
    if warmup_steps < 0:
        raise ValueError(f"lr_at: warmup_steps={warmup_steps} is negative; use 0 for no warmup")
    if total_steps < 1:
        raise ValueError(f"lr_at: total_steps={total_steps} must be >= 1")
    if step < warmup_steps:
        return (step + 1) / warmup_steps * lr
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0:
        return lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
