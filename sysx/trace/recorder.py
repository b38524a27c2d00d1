"""The per-rank timeline recorder: start and end of every op on every lane, for a window of steps.

Lanes of one rank: ``compute``, ``h2d`` / ``d2h``, ``p2p`` and one ``opt<i>`` per CPU optimizer
worker. Recording appends one tuple per mark; the events are placed on the host clock once, at the
end (:meth:`Recorder.spans`). Off costs one attribute check per op: components hold
``recorder = None`` unless a window is configured, and test :attr:`Recorder.on` otherwise.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from sysx import device as dev
from sysx.schedule.ops import COMMS, Op, OpKind

COMPUTE, H2D, D2H, P2P, OPT = "compute", "h2d", "d2h", "p2p", "opt"
Mark = dev.Event | float
# what a record is about: an op (of the rank's list), an optimizer job ``(label, stage name)``, or a
# name alone (a copy no op stands for, e.g. the sliding window's activation copies)
What = Op | tuple[str, str] | str


def op_lane(op: Op) -> str:
    """The lane an op of a rank's list is recorded on (an asynchronous OPTIM_STEP: one of the
    ``opt<i>`` lanes, reported here as ``opt``)."""
    k = op.kind
    if k == OpKind.LOAD_PARAMS:
        return H2D
    if k == OpKind.OFFLOAD_GRADS:
        return D2H
    if k in COMMS:
        return P2P
    if k == OpKind.OPTIM_STEP and op.is_async:
        return OPT
    return COMPUTE


def lane_family(lane: str) -> str:
    """``opt3`` -> ``opt``, ``p2p1`` -> ``p2p``; the other lanes are their own family."""
    return lane.rstrip("0123456789") or lane


def worker_lane() -> str:
    """The ``opt<i>`` lane of the calling optimizer worker (a pool thread named ``<prefix>_<i>``)."""
    name = threading.current_thread().name
    tail = name.rsplit("_", 1)[-1]
    return OPT + (tail if tail.isdigit() else name)


class Span(NamedTuple):
    """One recorded box, on the host clock in seconds (rank-local until :func:`~sysx.trace.timeline.merge`)."""

    rank: int
    step: int
    lane: str
    name: str
    op: Op | None  # an optimizer job: OPTIM_STEP of its sub-stage (is_async: the step job of an async OPTIM_STEP)
    start: float
    end: float
    nbytes: int = 0


@dataclass
class RankPart:
    """What one rank sends to rank 0 at the end of a window."""

    rank: int
    host: str
    starts: dict[int, float]  # host time at which each recorded step began on this rank
    spans: list[Span] = field(default_factory=list)


class Recorder:
    """Collects one rank's records for the steps ``first..last`` (see docs/architecture.md)."""

    def __init__(
        self, rank: int, device: torch.device | str, *, steps: tuple[int, int], compute: dev.Stream | None = None
    ) -> None:
        self.rank = rank
        self.device = torch.device(device)
        self.first, self.last = int(steps[0]), int(steps[1])
        self.compute = compute if compute is not None else dev.current_stream(self.device)
        self.on = False
        self.step = -1
        self.op: Op | None = None  # the op the executor runs: copies and messages are recorded under it
        self.records: list[tuple[int, str, What | None, Mark, Mark, int]] = []
        self.starts: dict[int, float] = {}
        self.base: dev.TimeBase | None = None

    def wants(self, step: int) -> bool:
        """True when ``step`` lies in the window."""
        return self.first <= step <= self.last

    def begin_step(self, step: int) -> None:
        """Start recording ``step`` (the first call also takes the window's time base)."""
        if self.base is None:
            self.base = dev.TimeBase(self.device)
        self.step = step
        self.starts[step] = time.monotonic()
        self.on = True

    def end_step(self) -> None:
        """Stop recording until the next :meth:`begin_step`."""
        self.on = False
        self.op = None

    def mark(self, stream: dev.Stream | None = None) -> dev.Event:
        """A timing event recorded now on ``stream`` (default: the compute stream)."""
        return (stream if stream is not None else self.compute).record_event(timing=True)

    @staticmethod
    def now() -> float:
        """The host clock of the host lanes (p2p, optimizer workers)."""
        return time.monotonic()

    def add(self, lane: str, what: What | None, start: Mark, end: Mark, nbytes: int = 0) -> None:
        """Append one record of the current step (``what`` None: the op the executor runs)."""
        self.records.append((self.step, lane, what if what is not None else self.op, start, end, nbytes))

    def add_job(self, label: str, stage: str, start: float, end: float) -> None:
        """Record an optimizer job of the calling worker thread (``label`` "" for a step)."""
        self.records.append((self.step, worker_lane(), (label, stage), start, end, 0))

    def spans(self, units: Mapping[str, tuple[int, int]] | None = None) -> list[Span]:
        """The records on the host clock (waits for the device's recorded work). ``units`` gives the
        optimizer stages' sub-stages: a job on a known stage becomes an OPTIM_STEP of it, asynchronous
        for the job of the op list's asynchronous OPTIM_STEP (a step, or with validate-first only the
        ``load`` and check of the gradients), synchronous for the validation's jobs (check, undo, clip,
        the validate-first step); a job on an unknown stage, or ``rollback=exact``'s background
        ``refresh`` (no op of the list: it runs off the critical path), has no op."""
        units = units or {}
        out = []
        for step, lane, what, start, end, nbytes in self.records:
            if isinstance(what, Op):
                name, op = what.trace_name(), what
            elif what is None or isinstance(what, str):
                name, op = what or lane, None
            else:
                label, stage = what
                name = f"OPT {label} {stage}" if label else f"OPT {stage}"
                unit = units.get(stage) if label != "refresh" else None
                op = (
                    Op(OpKind.OPTIM_STEP, unit[0], unit[1], is_async=label in ("", "load"))
                    if unit is not None
                    else None
                )
            out.append(Span(self.rank, step, lane, name, op, self._seconds(start), self._seconds(end), nbytes))
        return out

    def _seconds(self, mark: Mark) -> float:
        return mark if isinstance(mark, float) else mark.timestamp(self.base)

    def part(self, units: Mapping[str, tuple[int, int]] | None = None) -> RankPart:
        """This rank's share of the window, ready to gather."""
        return RankPart(self.rank, socket.gethostname(), dict(self.starts), self.spans(units))

    def clear(self) -> None:
        """Forget the window's records (after they were written)."""
        self.records.clear()
        self.starts.clear()
        self.base = None
