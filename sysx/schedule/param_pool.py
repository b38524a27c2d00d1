"""Where a rank's loaded parameters sit in its one device parameter buffer (the pool).

A rank's LOAD_PARAMS / FREE ops say which units (a forward stage, or a backward sub-stage) are on
the device from when to when; their sizes differ (SysX loads a whole stage for its forward passes
and each sub-stage, a third of it, for the backward). The op list is known before the first step,
so every load's place is chosen then, once (:func:`place_loads`): the larger of two packings is
dropped, largest-first (each load, largest first, at the lowest offset free of every load it is
on the device with: the planners' usual heuristic for a known sequence) and equal buffers (the
``i``-th free of ``param_buffers`` buffers, each as large as the largest unit, which the runtime
used before). :class:`sysx.runtime.buffers.ParamPool` copies each load to its place, and
:mod:`sysx.schedule.engine` charges the pool's size, so the plan's parameter memory is the bytes the
runtime allocates (equal buffers alone held up to 1.7x what the plan counted: issue 27).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

# a gap "fits" up to this fraction of the unit: sizes in bytes or elements are exact integers, the
# unit cost model's fractions (1/d of a stage) are not, and a third plus two thirds must fill a whole
_FIT_TOLERANCE = 1e-9


@dataclass(frozen=True)
class PoolPlan:
    """``offsets[i]``: where the ``i``-th load of the list goes; ``size``: the pool's length."""

    offsets: tuple[float, ...]
    size: float


def _intervals(events: Sequence[tuple[bool, Hashable, float]]) -> list[tuple[int, int, float]]:
    """``(first event, last event, size)`` of each load, in load order (a unit never freed stays to the end)."""
    spans: list[tuple[int, int, float]] = []
    open_: dict[Hashable, int] = {}
    for i, (is_load, key, n) in enumerate(events):
        if is_load:
            if key in open_:
                raise ValueError(f"event {i}: {key!r} is loaded twice without a free")
            open_[key] = len(spans)
            spans.append((i, len(events), n))
        else:
            if key not in open_:
                raise ValueError(f"event {i}: {key!r} is freed but not loaded")
            k = open_.pop(key)
            spans[k] = (spans[k][0], i, spans[k][2])
    return spans


def _largest_first(spans: list[tuple[int, int, float]]) -> PoolPlan:
    offsets = [0.0] * len(spans)
    placed: list[tuple[int, int, float, float]] = []
    for k in sorted(range(len(spans)), key=lambda k: (-spans[k][2], spans[k][0])):
        start, end, n = spans[k]
        at = 0.0
        for lo, hi in sorted((lo, hi) for s, e, lo, hi in placed if s < end and start < e):
            if lo - at >= n * (1.0 - _FIT_TOLERANCE):
                break
            at = max(at, hi)
        placed.append((start, end, at, at + n))
        offsets[k] = at
    return PoolPlan(tuple(offsets), max((hi for *_, hi in placed), default=0.0))


def _equal_buffers(spans: list[tuple[int, int, float]]) -> PoolPlan:
    largest = max((n for *_, n in spans), default=0.0)
    busy: list[int] = []  # per buffer, the event that frees its current load
    offsets = []
    for start, end, _ in spans:  # in load order = start order
        slot = next((i for i, e in enumerate(busy) if e <= start), len(busy))
        if slot == len(busy):
            busy.append(end)
        busy[slot] = end
        offsets.append(slot * largest)
    return PoolPlan(tuple(offsets), len(busy) * largest)


def place_loads(events: Sequence[tuple[bool, Hashable, float]]) -> PoolPlan:
    """Places of the loads of one op list, given as ``(is_load, unit, size)`` per LOAD_PARAMS / FREE:
    the smaller of the two packings (see the module doc); ties go to largest-first."""
    spans = _intervals(events)
    a, b = _largest_first(spans), _equal_buffers(spans)
    return a if a.size <= b.size * (1.0 + _FIT_TOLERANCE) else b
