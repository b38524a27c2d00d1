"""A measured window as a Chrome trace (``timeline.json``): one process per rank (``pid`` = rank), one
thread per lane, complete events in microseconds from the window's start. Opens in
https://ui.perfetto.dev or chrome://tracing (the file format is :func:`sysx.schedule.draw.write_trace`'s)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sysx.schedule.draw import write_trace
from sysx.trace.recorder import COMPUTE, D2H, H2D, OPT, P2P, Span, lane_family

_ORDER = {COMPUTE: 0, H2D: 1, D2H: 2, P2P: 3, OPT: 4}


def lane_order(lane: str) -> tuple[int, int, str]:
    """Sort key: compute, h2d, d2h, p2p, p2p1, ..., opt0, opt1, ..., then anything else by name."""
    family = lane_family(lane)
    tail = lane[len(family) :]
    return _ORDER.get(family, len(_ORDER)), int(tail) if tail.isdigit() else -1, lane


def write_chrome(spans: Sequence[Span], path: str | Path, *, title: str, n_ranks: int) -> Path:
    """Write ``spans`` (merged, see :func:`sysx.trace.timeline.merge`) to ``path``."""
    lanes: dict[int, list[str]] = {r: [COMPUTE] for r in range(n_ranks)}
    for s in spans:
        if s.lane not in lanes.setdefault(s.rank, []):
            lanes[s.rank].append(s.lane)
    for names in lanes.values():
        names.sort(key=lane_order)
    processes = [(r, f"{title} rank {r}", names) for r, names in sorted(lanes.items())]
    boxes = []
    for s in spans:
        args: dict[str, object] = {"step": s.step}
        if s.op is not None:
            args.update(kind=s.op.kind.name, stage=s.op.stage, sub=s.op.sub, mb=s.op.mb, is_async=s.op.is_async)
        if s.nbytes:
            args["bytes"] = s.nbytes
        boxes.append(
            {
                "name": s.name,
                "cat": lane_family(s.lane),
                "pid": s.rank,
                "tid": lanes[s.rank].index(s.lane),
                "ts": s.start * 1e6,
                "dur": (s.end - s.start) * 1e6,
                "args": args,
            }
        )
    return write_trace(path, processes, boxes)
