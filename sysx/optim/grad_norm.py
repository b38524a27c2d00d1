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
A piece cut between ranks (a spread step's shards, :mod:`sysx.schedule.spread`) keeps those bits
too (:class:`NormSlots`): its shards are cut on the piece's chunk grid (:func:`grid_shards`), so
every chunk adds up as it would whole; the part holding the piece's start adds its chunks into the
piece's slot, every later chunk gets a slot of its own, and after the all-reduce those are added to
the piece's slot in chunk order: the sum of the unsplit piece, operation for operation.
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
    contiguous and covering the buffer; ``of``: how many pieces the model has. ``tails``: ``(piece,
    first chunk, first slot)`` of each piece whose later chunks have slots of their own
    (:class:`NormSlots`); ``starts[i]``: where span ``i`` begins in its piece (empty: at 0)."""

    of: int
    spans: tuple[tuple[int, int, int], ...]
    tails: tuple[tuple[int, int, int], ...] = ()
    starts: tuple[int, ...] = ()

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


def layer_pieces(
    numels: Sequence[int], layers: range, cut: range | None = None, slots: NormSlots | None = None
) -> Pieces:
    """The pieces of a unit made of ``layers`` (``numels[i]``: layer ``i``'s parameters, flattened in
    layer order); ``cut``: the unit's elements this buffer holds (a replica's shard), else all;
    ``slots``: the norm's slots, whose tails this buffer's later chunks go to."""
    n = sum(numels[i] for i in layers)
    cut = range(n) if cut is None else cut
    spans, starts, start = [], [], 0
    for layer in layers:
        lo, hi = max(start, cut.start), min(start + numels[layer], cut.stop)
        if hi > lo:
            spans.append((layer, lo - cut.start, hi - lo))
            starts.append(lo - start)
        start += numels[layer]
    mine = {p for p, _, _ in spans}
    tails = tuple(t for t in slots.tails if t[0] in mine) if slots is not None else ()
    return Pieces(len(numels), tuple(spans), tails, tuple(starts) if tails else ())


def slot_chunks(pieces: Pieces, chunk: int) -> Iterator[tuple[int, int, int]]:
    """``(slot, lo, hi)``: :func:`piece_chunks` with each chunk's norm slot, its piece's, or for a
    chunk of a piece's tail (:class:`NormSlots`) its own."""
    tails = {piece: (first, slot) for piece, first, slot in pieces.tails}
    if not tails:
        yield from piece_chunks(pieces, chunk)
        return
    for i, (piece, offset, numel) in enumerate(pieces.spans):
        at = pieces.starts[i]  # where the span begins in its piece, on the piece's chunk grid
        if piece in tails and at % chunk:
            raise ValueError(f"piece {piece} is cut at {at}, off its chunk grid of {chunk}")
        for lo in range(offset, offset + numel, chunk):
            index = (at + lo - offset) // chunk
            first, slot = tails.get(piece, (index + 1, piece))
            yield (slot + index - first if index >= first else piece), lo, min(offset + numel, lo + chunk)


@dataclass(frozen=True)
class NormSlots:
    """The all-reduced vector of the squared norm: a slot per piece, then the tails: ``(piece, first
    chunk, first slot)``, the chunks of ``piece`` from ``first chunk`` on, one slot each (a piece cut
    between ranks, :func:`grid_shards`). :meth:`total` adds each tail into its piece in chunk order."""

    of: int
    tails: tuple[tuple[int, int, int], ...] = ()
    size: int = 0  # slots in all (0: ``of``)

    @classmethod
    def cut(cls, of: int, pieces: Sequence[tuple[int, int, Sequence[int]]], chunk: int) -> NormSlots:
        """The slots of a model of ``of`` pieces whose ``pieces`` are cut: ``(piece, numel, cuts)``,
        each cut an offset in the piece on its ``chunk`` grid."""
        tails, slot = [], of
        for piece, numel, cuts in sorted(pieces):
            inner = [c for c in cuts if 0 < c < numel]
            if not inner:
                continue
            first = min(inner) // chunk
            tails.append((piece, first, slot))
            slot += -(-numel // chunk) - first
        return cls(of, tuple(tails), slot)

    @property
    def length(self) -> int:
        """Slots in all."""
        return self.size or self.of

    def total(self, values: Sequence[float]) -> float:
        """The squared norm from the all-reduced slots: each tail added to its piece, then
        :func:`sum_slots` of the pieces."""
        out = list(values[: self.of])
        ends = [slot for _, _, slot in self.tails[1:]] + [self.length]
        for (piece, _, slot), end in zip(self.tails, ends):
            x = out[piece]
            for j in range(slot, end):
                x += values[j]
            out[piece] = x
        return sum_slots(out)


def grid_shards(numels: Sequence[int], shards: int, chunk: int) -> list[range]:
    """A unit of pieces of ``numels`` in ``shards`` contiguous shards, as equal as cuts on each
    piece's ``chunk`` grid allow (:func:`sysx.replicas.shard_range`'s cuts moved to the nearest grid
    point of the piece they fall in, or its end); a shard may be empty when the unit is small."""
    n = sum(numels)
    starts = [sum(numels[:i]) for i in range(len(numels))]
    cuts = [0]
    for j in range(1, shards):
        ideal = j * (n // shards) + min(j, n % shards)
        i = max(i for i, s in enumerate(starts) if s <= ideal) if ideal < n else len(numels) - 1
        grid = [*range(starts[i], starts[i] + numels[i], chunk), starts[i] + numels[i]]
        cuts.append(max(cuts[-1], min(grid, key=lambda g: (abs(g - ideal), g))))
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def grid_cuts(numels: Sequence[int], shards: Sequence[range]) -> list[tuple[int, int, list[int]]]:
    """``(piece index in the unit, numel, cuts in the piece)`` of every piece the shards cut inside."""
    out, start = [], 0
    for i, numel in enumerate(numels):
        inner = [s.start - start for s in shards if start < s.start < start + numel]
        if inner:
            out.append((i, numel, inner))
        start += numel
    return out


def piece_chunks(pieces: Pieces, chunk: int) -> Iterator[tuple[int, int, int]]:
    """``(piece, lo, hi)`` in buffer order: each piece in chunks of ``chunk`` from its own start, so a
    piece is added up the same way in whichever unit it sits."""
    for piece, offset, numel in pieces.spans:
        for lo in range(offset, offset + numel, chunk):
            yield piece, lo, min(offset + numel, lo + chunk)


def piece_slots(parts: Sequence[Sequence[tuple[int, float]]], of: int) -> torch.Tensor:
    """A float64 vector of ``of`` slots holding ``parts``' ``(slot, squared norm)`` (a rank's finite
    stages); a piece a replica holds a shard of gets one addend from each replica."""
    slots = [0.0] * of
    for part in parts:
        for piece, sq in part:
            slots[piece] += sq
    return torch.tensor(slots, dtype=torch.float64)


def sum_slots(slots: Sequence[float]) -> float:
    """The slots' sum, in piece order and rounded once (:func:`math.fsum`)."""
    return math.fsum(slots)
