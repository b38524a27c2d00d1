"""Which parameters get weight decay: the matrices, not the 1-D parameters (``optim.decay_norms``).

Megatron, the Hugging Face Trainer and nanoGPT decay the weight matrices (attention and MLP
projections, embedding, lm_head) and leave the 1-D parameters alone (norm weights, biases);
``optim.decay_norms=true`` decays every parameter (sysx before this rule). A host optimizer steps
one flat buffer, so its no-decay set is data: sorted, disjoint ``(start, stop)`` element ranges
(:data:`Ranges`), derived once from the buffer's layout (:func:`no_decay_ranges`), cut to a
replica's shard (:func:`shard_ranges`), and turned into the runs a step walks (:func:`decay_runs`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

Ranges = tuple[tuple[int, int], ...]  # element ranges [start, stop) of a flat buffer that get no weight decay


def decays(shape: Sequence[int]) -> bool:
    """Whether a parameter of ``shape`` gets weight decay: matrices yes, 1-D (norm weights, biases) no."""
    return len(shape) >= 2


def no_decay_ranges(shapes: Iterable[Sequence[int]]) -> Ranges:
    """The ranges of the 1-D parameters of a flat buffer holding parameters of ``shapes`` back to
    back (a :class:`~sysx.model.FlatLayout`'s order), adjacent ones merged."""
    out: list[tuple[int, int]] = []
    offset = 0
    for shape in shapes:
        numel = 1
        for n in shape:
            numel *= int(n)
        if not decays(shape) and numel:
            if out and out[-1][1] == offset:
                out[-1] = (out[-1][0], offset + numel)
            else:
                out.append((offset, offset + numel))
        offset += numel
    return tuple(out)


def shard_ranges(ranges: Ranges, start: int, stop: int) -> Ranges:
    """``ranges`` cut to elements ``[start, stop)`` of the buffer and counted from ``start`` (a
    replica's shard of a unit, :mod:`sysx.replicas`)."""
    return tuple((max(lo, start) - start, min(hi, stop) - start) for lo, hi in ranges if lo < stop and hi > start)


def check_ranges(ranges: Sequence[tuple[int, int]], numel: int) -> Ranges:
    """``ranges`` as a tuple after checking they are sorted, disjoint, non-empty and inside ``numel``
    elements; ValueError naming the first bad range otherwise."""
    last = 0
    for lo, hi in ranges:
        if not (last <= lo < hi <= numel):
            raise ValueError(
                f"CpuAdam: no_decay range ({lo}, {hi}) must be non-empty, sorted, disjoint and within [0, {numel}) "
                "(sysx.optim.decay.no_decay_ranges derives them from a layout)"
            )
        last = hi
    return tuple((int(lo), int(hi)) for lo, hi in ranges)


def decay_runs(numel: int, chunk: int, no_decay: Ranges) -> list[tuple[int, int, bool]]:
    """``[0, numel)`` in chunks of at most ``chunk`` elements, each cut further at the edges of
    ``no_decay``: ``(start, stop, decays)`` runs in order. Norm ranges are small, so a block adds a
    few short runs to its chunks."""
    edges = sorted({e for r in no_decay for e in r} | set(range(0, numel, chunk)) | {numel})
    runs = []
    k = 0
    for lo, hi in zip(edges, edges[1:]):
        while k < len(no_decay) and no_decay[k][1] <= lo:
            k += 1
        inside = k < len(no_decay) and no_decay[k][0] <= lo
        runs.append((lo, hi, not inside))
    return runs


def param_groups(params: Iterable[torch.Tensor], weight_decay: float, decay_norms: bool) -> list[dict[str, Any]]:
    """``torch.optim`` parameter groups: the decayed parameters with ``weight_decay``, then the 1-D
    ones without (one group of all with ``weight_decay`` when ``decay_norms``)."""
    params = list(params)
    if decay_norms:
        return [{"params": params, "weight_decay": weight_decay}]
    groups = [
        {"params": [p for p in params if decays(p.shape)], "weight_decay": weight_decay},
        {"params": [p for p in params if not decays(p.shape)], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]
