"""The global gradient norm with the same bits in every layout.

Summed per optimizer unit, the squared norm depends on how the layout cuts the model: each unit adds
its chunks in its own order and the ranks' totals are added in the all-reduce's order, so a run at 4
ranks and one at 2 ranks can differ in the norm's last bit (measured: 1.9742635860091096 against
...098 at step 0 of ``tests/test_checkpoint_procs.py``'s 4 -> 2 rank move on an Intel Xeon; equal on
the AMD EPYC the test was written on) and, through the clipping coefficient, in the weights. So a
unit sums its squares per *piece* of the model (a layer: the unit of a checkpoint), in chunks
aligned at the piece's start (:func:`piece_chunks`); the ranks add their pieces into one vector with
a slot per piece (:func:`piece_slots`), where every slot has one contributor, so the all-reduce adds
only zeros to it; and every rank sums the vector in piece order, rounded once (:func:`sum_slots`).
The pieces themselves add up alike when the optimizer workers have as many intra-op threads (a
parallel reduction splits by thread): on this 2-core machine one each at 2 and at 4 ranks; on a
bigger node the core plan gives fewer threads to each of more ranks, and a piece's last bit can
then differ across rank counts per node.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pieces:
    """Where the model's pieces lie in one unit's flat buffer: ``spans[i] = (piece, offset, numel)``,
    contiguous and covering the buffer; ``of``: how many pieces the model has."""

    of: int
    spans: tuple[tuple[int, int, int], ...]

    def __post_init__(self) -> None:
        at = 0
        for piece, offset, numel in self.spans:
            if offset != at or numel <= 0 or not 0 <= piece < self.of:
                raise ValueError(f"pieces {self.spans} of {self.of}: need contiguous non-empty spans from 0")
            at += numel

    @property
    def numel(self) -> int:
        """Elements the spans cover."""
        return sum(n for _, _, n in self.spans)


def layer_pieces(numels: Sequence[int], layers: range, cut: range | None = None) -> Pieces:
    """The pieces of a unit made of ``layers`` (``numels[i]``: layer ``i``'s parameters, flattened in
    layer order); ``cut``: the unit's elements this buffer holds (a replica's shard), else all."""
    n = sum(numels[i] for i in layers)
    cut = range(n) if cut is None else cut
    spans, start = [], 0
    for layer in layers:
        lo, hi = max(start, cut.start), min(start + numels[layer], cut.stop)
        if hi > lo:
            spans.append((layer, lo - cut.start, hi - lo))
        start += numels[layer]
    return Pieces(len(numels), tuple(spans))


def piece_chunks(pieces: Pieces, chunk: int) -> Iterator[tuple[int, int, int]]:
    """``(piece, lo, hi)`` in buffer order: each piece in chunks of ``chunk`` from its own start, so a
    piece is added up the same way in whichever unit it sits."""
    for piece, offset, numel in pieces.spans:
        for lo in range(offset, offset + numel, chunk):
            yield piece, lo, min(offset + numel, lo + chunk)


def piece_slots(parts: Sequence[Sequence[tuple[int, float]]], of: int) -> torch.Tensor:
    """A float64 vector of ``of`` slots holding ``parts``' ``(piece, squared norm)`` (a rank's finite
    stages); a piece a replica holds a shard of gets one addend from each replica."""
    slots = [0.0] * of
    for part in parts:
        for piece, sq in part:
            slots[piece] += sq
    return torch.tensor(slots, dtype=torch.float64)


def sum_slots(slots: Sequence[float]) -> float:
    """The slots' sum, in piece order and rounded once (:func:`math.fsum`)."""
    return math.fsum(slots)
