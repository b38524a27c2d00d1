"""Where the layers of a model being sampled live: all resident on the device, or streamed through a
ring of ``window`` device slots, with the KV cache of every block on the device either way.

The embedding is looked up in host memory (a prompt's rows are all it needs), so the device holds the
blocks and the head (norm + output projection), each as one flat buffer (:class:`~sysx.model.flat.FlatLayout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sysx.generate import GenerateError
from sysx.memory.budget import fmt_bytes
from sysx.model.config import ModelConfig
from sysx.single.rings import align

GiB = 1024**3


def gib_up(n: int) -> str:
    """``n`` bytes in GiB, rounded up at 4 significant digits (a budget given back is never too small)."""
    x = n / GiB
    scale = 10.0 ** (3 - math.floor(math.log10(x)))
    return f"{math.ceil(x * scale) / scale:g}"


def kv_cache_bytes(cfg: ModelConfig, positions: int, dtype: torch.dtype) -> int:
    """Keys and values of every block for ``positions`` positions of one sequence."""
    return cfg.n_layers * 2 * cfg.n_kv_heads * positions * cfg.head_dim * dtype.itemsize


def work_bytes(cfg: ModelConfig, prompt_len: int, positions: int, dtype: torch.dtype) -> int:
    """An upper estimate of the temporaries of the prefill, the largest pass: the hidden states and the
    block's projections of the prompt, its attention scores (fp32, as the math kernel makes them) and
    the fp32 logits of the last position."""
    per_token = 4 * cfg.dim + 2 * cfg.n_kv_heads * cfg.head_dim + 3 * cfg.ffn_dim
    scores = cfg.n_heads * prompt_len * positions * 4
    return prompt_len * per_token * dtype.itemsize + scores + cfg.vocab_size * 4


@dataclass(frozen=True)
class Placement:
    """The plan: ``window`` slots for ``len(unit_bytes)`` layers (all of them when ``resident``)."""

    resident: bool
    window: int
    unit_bytes: tuple[int, ...]
    kv_bytes: int
    work_bytes: int
    budget: int | None

    @property
    def slot_bytes(self) -> int:
        """One ring slot: the largest layer."""
        return max(self.unit_bytes)

    @property
    def layer_bytes(self) -> int:
        """All layers, each aligned as the device arena lays them out."""
        return sum(align(b) for b in self.unit_bytes)

    @property
    def device_bytes(self) -> int:
        """What the plan allocates on the device (layers or ring, KV cache) plus the work estimate."""
        layers = self.layer_bytes if self.resident else self.window * align(self.slot_bytes)
        return layers + align(self.kv_bytes) + self.work_bytes

    def describe(self) -> str:
        """One line: the mode and why."""
        sizes = f"layers {fmt_bytes(self.layer_bytes)}, KV cache {fmt_bytes(self.kv_bytes)}"
        if self.budget is None:
            return f"resident: {len(self.unit_bytes)} layers on the device ({sizes}; no device budget given)"
        if self.resident:
            return (
                f"resident: all {len(self.unit_bytes)} layers ({sizes}, work ~{fmt_bytes(self.work_bytes)}) "
                f"fit the device budget {fmt_bytes(self.budget)}"
            )
        return (
            f"streamed with window W={self.window} of {len(self.unit_bytes)} layers (slots of "
            f"{fmt_bytes(self.slot_bytes)}): {sizes}, work ~{fmt_bytes(self.work_bytes)} exceed the device "
            f"budget {fmt_bytes(self.budget)}; the KV cache stays on the device, layers stream from host memory"
        )


def plan_placement(unit_bytes: list[int], kv_bytes: int, work: int, budget: int | None) -> Placement:
    """Resident when every layer, the KV cache and the work fit ``budget`` (or there is none); else the
    widest ring that fits beside the KV cache. Not even one slot: a :class:`GenerateError` naming the fix."""
    resident = Placement(True, len(unit_bytes), tuple(unit_bytes), kv_bytes, work, budget)
    if budget is None or resident.device_bytes <= budget:
        return resident
    fixed = align(kv_bytes) + work
    window = min((budget - fixed) // align(max(unit_bytes)), len(unit_bytes) - 1)
    if window < 1:
        need = fixed + align(max(unit_bytes))
        raise GenerateError(
            f"--device-memory-gb {budget / GiB:.4g}: the KV cache ({fmt_bytes(kv_bytes)}) plus one layer "
            f"({fmt_bytes(max(unit_bytes))}) and the work (~{fmt_bytes(work)}) need {fmt_bytes(need)}; "
            f"give --device-memory-gb {gib_up(need)} or more, or lower --max-new-tokens (the KV cache is "
            f"sized for the prompt plus --max-new-tokens)"
        )
    return Placement(False, int(window), tuple(unit_bytes), kv_bytes, work, budget)
