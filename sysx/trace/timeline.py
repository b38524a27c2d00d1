"""Measured records -> one window on one clock, and per-step :class:`~sysx.schedule.Timeline` s that
:mod:`sysx.schedule.draw` draws exactly like the plans of ``sysx plan``.

Clocks: ranks on one host share ``time.monotonic()``, so their spans are placed on it as they are.
Ranks on several hosts do not; each rank's spans are then placed relative to the start of its
first recorded step (a step starts right after the all-reduce that ended the previous one, so the
ranks start it within that all-reduce's skew).
"""

from __future__ import annotations

from collections.abc import Sequence

from sysx.schedule.ops import SENDS, OpKind, Schedule
from sysx.schedule.simulate import Event, Timeline
from sysx.trace.recorder import COMPUTE, D2H, H2D, OPT, P2P, RankPart, Span, lane_family

PASSES = (OpKind.FORWARD, OpKind.BACKWARD)
SEND_MARK = 0.002  # width of a measured send's mark, as a fraction of the step


def merge(parts: Sequence[RankPart]) -> list[Span]:
    """Every rank's spans on one clock whose zero is the window's start, the p2p lane of each rank
    split into as many ``p2p``, ``p2p1``, ... lanes as transfers overlap (see :func:`pack_lanes`)."""
    if not parts:
        return []
    one_host = len({p.host for p in parts}) == 1
    firsts = {p.rank: p.starts[min(p.starts)] for p in parts if p.starts}
    common = min(firsts.values(), default=0.0)
    out: list[Span] = []
    for part in parts:
        zero = common if one_host else firsts.get(part.rank, common)
        out += [s._replace(start=s.start - zero, end=s.end - zero) for s in part.spans]
    return pack_lanes(out, P2P)


def pack_lanes(spans: Sequence[Span], family: str) -> list[Span]:
    """Give the spans of lane ``family`` (per rank) sub-lanes ``family``, ``family1``, ... so that
    no two overlap on one lane (concurrent transfers: isends in flight while a blocking one runs).
    Each span takes the first sub-lane free at its start, in order of start."""
    out = [s for s in spans if s.lane != family]
    ends: dict[int, list[float]] = {}
    for s in sorted((s for s in spans if s.lane == family), key=lambda s: (s.rank, s.start, s.end)):
        lanes = ends.setdefault(s.rank, [])
        i = next((k for k, end in enumerate(lanes) if end <= s.start), len(lanes))
        if i == len(lanes):
            lanes.append(0.0)
        lanes[i] = s.end
        out.append(s._replace(lane=family if i == 0 else f"{family}{i}"))
    return out


def steps_of(spans: Sequence[Span]) -> list[int]:
    """The recorded steps, in order."""
    return sorted({s.step for s in spans})


def step_bounds(spans: Sequence[Span], step: int) -> tuple[float, float]:
    """``(first start, last end)`` of ``step`` over every rank and lane."""
    mine = [s for s in spans if s.step == step]
    if not mine:
        raise ValueError(f"no span of step {step} was recorded")
    return min(s.start for s in mine), max(s.end for s in mine)


def _draw_lane(s: Span) -> str | None:
    """The lane :mod:`sysx.schedule.draw` shows a span on (the simulator's names), or None."""
    if s.op is None:
        return None
    family = lane_family(s.lane)
    if family == COMPUTE:
        if s.op.kind in PASSES:
            return "gpu"
        return "cpu" if s.op.kind == OpKind.OPTIM_STEP else None  # a synchronous step holds the cursor
    if family == OPT:
        return "cpu"
    if family in (H2D, D2H):
        return family
    if family == P2P and s.op.kind in SENDS:
        return "p2p"  # the simulator draws a transfer on its sender's row
    return None


def step_timeline(
    spans: Sequence[Span], step: int, *, n_ranks: int, name: str, schedule: Schedule | None = None
) -> Timeline:
    """The measured ``step`` as a :class:`Timeline` (times from the step's first op, in seconds;
    memory peaks are not recorded and stay 0). ``schedule``: the op lists the spans ran, if any."""
    lo, hi = step_bounds(spans, step)
    iteration = hi - lo
    R = n_ranks
    events: list[Event] = []
    busy, gpu_end = [0.0] * R, [0.0] * R
    for s in spans:
        lane = _draw_lane(s) if s.step == step else None
        if lane is None or s.op is None:
            continue
        end = s.end
        if lane == "p2p":
            # a send is an isend: its span runs from the post to the sender's wait, which may come long
            # after the transfer ended, so it is drawn as a mark at its post (the plan draws transfers)
            end = min(end, s.start + SEND_MARK * iteration)
        events.append(Event(s.rank, lane, s.op, s.start - lo, end - lo))
        if lane == "gpu":
            busy[s.rank] += s.end - s.start
            gpu_end[s.rank] = max(gpu_end[s.rank], s.end - lo)
    bubble = [1.0 - b / iteration if iteration > 0 else 0.0 for b in busy]
    zeros = [0.0] * R
    return Timeline(
        f"{name} step {step} (measured)",
        R,
        iteration,
        busy,
        bubble,
        sum(bubble) / R,
        gpu_end,
        zeros,
        zeros,
        zeros,
        zeros,
        zeros,
        zeros,
        zeros,
        R,
        "s",
        sorted(events, key=lambda e: (e.rank, e.start)),
        schedule,
    )


def step_timelines(
    spans: Sequence[Span], *, n_ranks: int, name: str, schedule: Schedule | None = None
) -> list[Timeline]:
    """One measured :class:`Timeline` per recorded step."""
    return [step_timeline(spans, step, n_ranks=n_ranks, name=name, schedule=schedule) for step in steps_of(spans)]
