"""Emulated CUDA streams and events: work on a stream has a modelled start and end on the host's
monotonic clock (shared by every process of the machine).

Same interface as :class:`sysx.device.Stream` / :class:`sysx.device.Event`, plus
:meth:`EmulatedStream.charge` / :meth:`EmulatedStream.charge_next` to give issued work its duration
and :meth:`EmulatedEvent.timestamp`, the modelled completion time. No thread runs the streams: the
real (small) copies happen at once on the issuing thread, only their completion times are modelled.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch

from sysx import device as dev

_current = threading.local()  # the stream a ``with stream.use():`` block of this thread issues on


def sleep_until(t: float) -> None:
    """Sleep until the monotonic clock reads ``t`` (returns at once when it is past)."""
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


class EmulatedStream(dev.Stream):
    """A stream whose work has modelled times (see docs/architecture.md).

    ``issue`` gives the time at which the host issues work (default: the clock): the copy streams of
    a rank take the host cursor, so that sleep overshoots of the host do not delay their work.
    """

    def __init__(self, name: str, *, issue: Callable[[], float] | None = None) -> None:
        super().__init__(torch.device("cpu"))
        self.name = name
        self.free = time.monotonic()  # when the work issued so far ends
        self.after = 0.0  # the latest event this stream was told to wait for
        self._issue = issue or time.monotonic
        self._next = 0.0

    def mark(self) -> float:
        """When an event recorded now completes: after the work issued so far, the events waited
        for, and not before it is issued (the start of the next work)."""
        return max(self._issue(), self.free, self.after)

    def charge(self, seconds: float) -> tuple[float, float]:
        """Issue ``seconds`` of work now; returns its modelled ``(start, end)``."""
        start = self.mark()
        self.free = start + seconds
        return start, self.free

    def charge_next(self, seconds: float) -> None:
        """The work of the next ``with stream.use():`` block takes ``seconds`` (added up until then)."""
        self._next += seconds

    @contextlib.contextmanager
    def use(self) -> Iterator[EmulatedStream]:
        """Issue the block's work here: it is charged the duration given by :meth:`charge_next`."""
        seconds, self._next = self._next, 0.0
        self.charge(seconds)
        previous = getattr(_current, "stream", None)
        _current.stream = self
        try:
            yield self
        finally:
            _current.stream = previous

    def wait_event(self, event: dev.Event) -> None:
        """Later work on this stream starts after ``event``."""
        event.wait(self)

    def wait_stream(self, other: dev.Stream) -> None:
        """Later work on this stream starts after the work issued so far on ``other``."""
        if isinstance(other, EmulatedStream):
            self.after = max(self.after, other.free)

    def record_event(self, *, timing: bool = False, blocking: bool = False) -> EmulatedEvent:
        """An event completing with the work issued so far on this stream."""
        return EmulatedEvent().record(self)

    def synchronize(self) -> None:
        """Sleep until the work issued so far on this stream ends."""
        sleep_until(self.free)


class EmulatedEvent(dev.Event):
    """An event with a modelled completion time (None until recorded)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.time: float | None = None

    def record(self, stream: dev.Stream | None = None) -> EmulatedEvent:
        """Complete with the work issued so far on ``stream`` (default: the stream of the enclosing
        ``use()`` block, else now)."""
        stream = stream if stream is not None else getattr(_current, "stream", None)
        self.time = stream.mark() if isinstance(stream, EmulatedStream) else time.monotonic()
        self._recorded = True
        return self

    def wait(self, stream: dev.Stream | None = None) -> None:
        """Make ``stream``'s later work start after this event (no host wait)."""
        stream = stream if stream is not None else getattr(_current, "stream", None)
        if self.time is not None and isinstance(stream, EmulatedStream):
            stream.after = max(stream.after, self.time)

    def synchronize(self) -> None:
        """Sleep until the modelled completion time."""
        if self.time is not None:
            sleep_until(self.time)

    def query(self) -> bool:
        """True once the modelled completion time has passed (or never recorded)."""
        return self.time is None or time.monotonic() >= self.time

    def timestamp(self, base: dev.TimeBase | None = None) -> float:
        """The modelled completion time, in ``time.monotonic()`` seconds (already on the host clock:
        ``base`` is not needed)."""
        if self.time is None:
            raise RuntimeError("timestamp() of an emulated event that was never recorded")
        return self.time

    def elapsed_ms(self, end: dev.Event) -> float:
        """Wall milliseconds between this event and ``end`` (both recorded)."""
        if not isinstance(end, EmulatedEvent):
            raise RuntimeError("elapsed_ms between an emulated and a device event")
        return (end.timestamp() - self.timestamp()) * 1000.0
