"""SIGINT and SIGTERM stop a job cleanly: the signal becomes :class:`JobStopped`, which unwinds
through the normal close paths (trainer, shared-memory store, process group) and ends the process
with status 128 + signal (130, 143) and one line.

With ``checkpoint.on_signal=true`` the stop waits for the end of the step (:func:`deferring`,
:func:`pending`); a repeated signal within :data:`REPEAT_GRACE_S` is absorbed, and so is the
launcher's SIGTERM to a rank that is :func:`ending` on a failure.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_GRACE_S = 3.0


class JobStopped(BaseException):
    """The job was asked to stop by a signal (here or on rank ``origin``). A BaseException, like
    KeyboardInterrupt, so that handlers of ordinary errors let it pass."""

    def __init__(self, signum: int, origin: int | None = None) -> None:
        self.signum = int(signum)
        self.origin = origin
        self.where = ""  # filled in on the way out: the step it stopped at, where the summary is
        where = "" if origin is None else f" (sent to rank {origin})"
        super().__init__(f"stopped by {signal_name(self.signum)}{where}")

    @property
    def exit_code(self) -> int:
        """The status a shell reports for a process ended by this signal: 130, 143."""
        return 128 + self.signum


def signal_name(signum: int) -> str:
    """``SIGINT`` for 2 (the number itself when it is not a signal)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


class _State:
    """What this process knows about a stop (one per process)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.origin: int | None = None
        self.first_at = 0.0
        self.defer = False
        self.ending = False  # ending on a failure: a signal now is the launcher tearing the job down
        self.absorbed_at: float | None = None
        self.installed: dict[int, object] = {}


_state = _State()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    now = time.monotonic()
    if _state.ending and (_state.absorbed_at is None or now - _state.absorbed_at < REPEAT_GRACE_S):
        _state.absorbed_at = _state.absorbed_at or now
        return  # the job is ending already; a signal after the grace raises (the user insists)
    if _state.signum is None:
        _state.signum, _state.first_at = signum, now
        if _state.defer:
            return
    elif now - _state.first_at < REPEAT_GRACE_S:
        return  # the launcher forwarding the signal this rank already got
    else:
        _state.first_at = now  # insisting: stop now, even while deferring
    raise JobStopped(signum)


def install() -> None:
    """Turn SIGINT and SIGTERM into :class:`JobStopped` in this process (main thread only;
    idempotent). Ignored signals stay ignored (a job started in the background by a shell)."""
    from sysx.memory import cleanup

    if threading.current_thread() is not threading.main_thread():
        return
    cleanup.install()  # the store's handlers first, so that ours sit above them
    for signum in STOP_SIGNALS:
        current = signal.getsignal(signum)
        if current == signal.SIG_IGN or current is _on_signal:
            continue
        _state.installed[signum] = current
        signal.signal(signum, _on_signal)


def reset() -> None:
    """Forget a stop request (a test that runs several jobs in one process)."""
    _state.signum, _state.origin, _state.defer = None, None, False
    _state.ending, _state.absorbed_at = False, None


def ending() -> None:
    """This process ends on a failure it has reported: a signal within :data:`REPEAT_GRACE_S` of
    the first that follows (a launcher stopping the job's other ranks) no longer interrupts it."""
    _state.ending = True


def pending() -> JobStopped | None:
    """The stop asked for so far (by a signal here or agreed with the other ranks), or None."""
    if _state.signum is None:
        return None
    return JobStopped(_state.signum, _state.origin)


def request(signum: int, origin: int | None = None) -> None:
    """Record a stop that another rank asked for (the signal went there)."""
    if _state.signum is None:
        _state.signum, _state.origin, _state.first_at = int(signum), origin, time.monotonic()


def raise_if_requested() -> None:
    """Raise :class:`JobStopped` when a stop is pending and not deferred to the end of the step."""
    if _state.signum is not None and not _state.defer:
        raise JobStopped(_state.signum, _state.origin)


@contextlib.contextmanager
def deferring(enabled: bool = True) -> Iterator[None]:
    """Inside: a signal only marks the stop (:func:`pending`); the step loop finishes the step,
    saves and stops. Outside (or ``enabled=False``): a signal raises at once."""
    before = _state.defer
    _state.defer = bool(enabled)
    try:
        yield
    finally:
        _state.defer = before
