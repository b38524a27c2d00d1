"""Segments are unlinked on every exit path, and the ones nobody cleaned up are found.

:func:`install` hooks the release of a process's owned segments into ``atexit``, a multiprocessing
finalizer and SIGTERM / SIGHUP; :func:`scan` / :func:`sweep_stale` find and remove *stale* segments
(creator gone, lock free) at the next start or through ``sysx shm clean``; :func:`sweep_lock` holds
a start's sweep off while stale segments are being looked at. Forked children inherit nothing: they
never unlink their parent's segments.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

from sysx.memory import guardian, procinfo
from sysx.memory.header import Header, SegmentError, read_header
from sysx.memory.names import SHM_DIR, SegmentName, current_user, user_entries

TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
BROKEN_GRACE_S = 10.0  # a headerless segment younger than this may still be under construction
SWEEP_WAIT_S = 30.0  # how long a job's start waits for another process's sweep lock before skipping its sweep


def detach_timeout_s(default: float = 30.0) -> float:
    """How long an exiting owner waits for attachers (``SYSX_SHM_DETACH_TIMEOUT``, seconds)."""
    try:
        return float(os.environ.get("SYSX_SHM_DETACH_TIMEOUT", default))
    except ValueError:
        return default


# --- what exists ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SegmentInfo:
    """One sysx segment as seen from ``/dev/shm``, without mapping it."""

    name: str  # POSIX name, with the leading slash
    path: str
    parsed: SegmentName | None
    size: int
    uid: int
    mode: int
    dev: int
    ino: int
    mtime: float
    header: Header | None
    error: str | None
    holders: list[int] | None  # pids mapping it (flock holders); None if unknown
    status: str  # alive | orphaned | stale | creating | broken

    @property
    def creator_pid(self) -> int | None:
        """The creator's pid, when the header is readable."""
        return self.header.creator_pid if self.header is not None else None

    @property
    def removable(self) -> bool:
        """True for segments nobody can be using any more (stale, or broken and old)."""
        return self.status in ("stale", "broken")


def classify(
    header: object | None, creator_alive: bool, holders: list[int] | None, age_s: float, error: str | None
) -> str:
    """Status of a segment (or of another scratch object with an owner record, e.g. an NVMe state
    directory): ``alive`` (creator running), ``orphaned`` (creator dead, still mapped by others),
    ``stale`` (creator dead, unused), ``creating`` (no header yet, young or locked), ``broken`` (no
    valid header and unused)."""
    in_use = bool(holders)
    if header is None:
        if error is None and (in_use or age_s < BROKEN_GRACE_S):
            return "creating"
        return "orphaned" if in_use else "broken"
    if creator_alive:
        return "alive"
    return "orphaned" if in_use else "stale"


def inspect(path: str) -> SegmentInfo | None:
    """Read a segment's header and users without mapping it; None if it vanished."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, PermissionError):
        return None
    try:
        st = os.fstat(fd)
        name = "/" + os.path.basename(path)
        error = None
        try:
            header = read_header(fd, name)
        except (SegmentError, ValueError) as exc:
            header, error = None, str(exc)
        holders = procinfo.lock_users(fd)
        alive = header is not None and header.creator_alive
        status = classify(header, alive, holders, time.time() - st.st_mtime, error)
        return SegmentInfo(
            name,
            path,
            SegmentName.parse(name),
            st.st_size,
            st.st_uid,
            st.st_mode & 0o777,
            st.st_dev,
            st.st_ino,
            st.st_mtime,
            header,
            error,
            holders,
            status,
        )
    finally:
        os.close(fd)


def scan(*, user: str | None = None, job: str | None = None, shm_dir: str = SHM_DIR) -> list[SegmentInfo]:
    """This user's sysx segments (file owned by our uid and named ``sysx-<user>-...``), sorted by
    name; ``job`` narrows to one job id."""
    uid = os.getuid()
    found = []
    for path, _ in user_entries(shm_dir, user=user, job=job):
        info = inspect(path)
        if info is not None and info.uid == uid:
            found.append(info)
    return found


def remove(info: SegmentInfo) -> bool:
    """Unlink the segment ``info`` describes, unless the name now points at another segment."""
    try:
        st = os.stat(info.path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != (info.dev, info.ino):
        return False
    try:
        os.unlink(info.path)
    except FileNotFoundError:
        return False
    return True


_sweep_locks_held: dict[str, int] = {}  # lock name -> depth, in this process
_sweep_locks_guard = threading.Lock()


@contextlib.contextmanager
def sweep_lock(user: str | None = None, *, wait_s: float = SWEEP_WAIT_S) -> Iterator[bool]:
    """Hold ``user``'s (default: this user's) sweep lock on this node; yields False if another
    process held it for all of ``wait_s`` seconds.

    Every :func:`sweep_stale` takes it, so while a process holds it no other process's start removes
    stale segments: a post-mortem or a test of the stale path sees them as the crash left them. It is
    reentrant within a process. It is an abstract Unix socket rather than a file, so there is nothing
    to clean up and the kernel frees it when the holder dies, even by SIGKILL. Its scope is the
    network namespace: containers that share ``/dev/shm`` but not the network do not exclude each
    other, which is harmless, since :func:`remove` checks the inode before it unlinks.
    """
    name = f"sysx-sweep-{os.getuid()}-{current_user() if user is None else user}"
    with _sweep_locks_guard:
        mine = _sweep_locks_held.get(name, 0) > 0
        if mine:
            _sweep_locks_held[name] += 1
    if mine:
        try:
            yield True
        finally:
            with _sweep_locks_guard:
                _sweep_locks_held[name] -= 1
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                sock.bind("\0" + name)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:  # no abstract sockets here: sweep unlocked, remove() checks inodes
                    break
                if time.monotonic() >= deadline:  # another process holds it
                    yield False
                    return
                time.sleep(0.05)
        with _sweep_locks_guard:
            _sweep_locks_held[name] = 1
        try:
            yield True
        finally:
            with _sweep_locks_guard:
                _sweep_locks_held[name] = 0
    finally:
        sock.close()


def sweep_stale(*, user: str | None = None, job: str | None = None, wait_s: float = SWEEP_WAIT_S) -> list[SegmentInfo]:
    """Remove this user's stale and broken segments (creator dead or never finished, nobody mapping
    them) under :func:`sweep_lock`; returns what was removed. When another process has held the lock
    for ``wait_s`` seconds it warns and removes nothing: the next start or ``sysx shm clean`` will."""
    with sweep_lock(user, wait_s=wait_s) as held:
        if not held:
            warnings.warn(
                f"sysx: another process of this user held the shared-memory sweep lock for {wait_s:g} s; "
                "stale segments were left for the next start (`sysx shm clean` removes them now)",
                RuntimeWarning,
                stacklevel=2,
            )
            return []
        removed = []
        for info in scan(user=user, job=job):
            if info.removable and remove(info):
                removed.append(info)
        return removed


# --- this process's segments and its exit paths -----------------------------------------------
class Segment(Protocol):
    """What the exit paths use of a :class:`sysx.memory.segment.Segment`. Named here rather than
    imported: segment.py registers every segment with this module, so it sits above it."""

    name: SegmentName
    _fd: int
    _pid: int

    def detach_lock(self) -> None: ...

    def mark_closing(self) -> None: ...

    def release(self, timeout_s: float = 30.0, *, deadline: float | None = None) -> bool: ...


_lock = threading.RLock()
_owned: list[Segment] = []
_attached: list[Segment] = []
_exit_hooks: list[Callable[[], None]] = []
_previous: dict[int, Any] = {}
_atexit_installed = False
_signals_installed = False
_fork_hook_installed = False
_mp_finalizer_pid = 0
_releasing = False


def register_owned(segment: Segment) -> None:
    """Unlink ``segment`` on every exit path of this process."""
    install()
    with _lock:
        _owned.append(segment)
    if guardian.enabled():
        guardian.GUARDIAN.track(segment.name.name, os.fstat(segment._fd).st_ino)


def register_attached(segment: Segment) -> None:
    """Track an attached segment (attachers never unlink; the kernel drops their lock at exit)."""
    install()
    with _lock:
        _attached.append(segment)


def unregister(segment: Segment) -> None:
    """Forget ``segment`` (it was released or closed)."""
    with _lock:
        for registry in (_owned, _attached):
            if any(s is segment for s in registry):
                registry[:] = [s for s in registry if s is not segment]
                if registry is _owned:
                    guardian.GUARDIAN.untrack(segment.name.name)


def register_exit_hook(hook: Callable[[], None]) -> None:
    """Run ``hook`` on this process's exit paths too (before its segments are released): scratch
    that is not a segment, such as the NVMe tier's state directories. A hook must be idempotent."""
    install()
    with _lock:
        _exit_hooks.append(hook)


def unregister_exit_hook(hook: Callable[[], None]) -> None:
    """Forget ``hook`` (its owner cleaned up itself)."""
    with _lock:
        _exit_hooks[:] = [h for h in _exit_hooks if h != hook]  # ==: a bound method is made anew at each access


def owned_segments() -> list[Segment]:
    """Segments this process created and has not released yet."""
    with _lock:
        return list(_owned)


def release_all(timeout_s: float | None = None) -> None:
    """Release (wait for attachers, unlink) every segment this process owns. Never raises: on an
    exit path a failure to clean one segment must not stop the others."""
    global _releasing
    timeout = detach_timeout_s() if timeout_s is None else timeout_s
    with _lock:
        if _releasing:
            return
        _releasing = True
        try:
            for hook in list(_exit_hooks):
                try:
                    hook()
                except Exception as exc:
                    sys.stderr.write(f"sysx: an exit cleanup failed: {exc}\n")
            pid = os.getpid()
            for segment in list(_attached):  # first stop holding others' segments: no cross-waiting
                with contextlib.suppress(OSError):
                    segment.detach_lock()
            mine = [segment for segment in _owned if segment._pid == pid]
            for segment in mine:  # no new attachers anywhere, then one shared wait
                with contextlib.suppress(OSError):
                    segment.mark_closing()
            deadline = time.monotonic() + timeout
            for segment in mine:
                try:
                    segment.release(deadline=deadline)
                except Exception as exc:
                    sys.stderr.write(f"sysx: could not release {segment.name.name}: {exc}\n")
        finally:
            _releasing = False


def _at_exit() -> None:
    release_all()
    guardian.GUARDIAN.shutdown()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    release_all(timeout_s=detach_timeout_s(10.0))  # shorter by default: a launcher escalates to SIGKILL
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)  # default action: die by this signal, as before
    os.kill(os.getpid(), signum)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
    _owned.clear()
    _attached.clear()
    _exit_hooks.clear()
    guardian.GUARDIAN.forget_after_fork()


def install() -> None:
    """Install the atexit hook and (from the main thread) the SIGTERM/SIGHUP handlers; idempotent.

    A signal whose handler is ``SIG_IGN`` is left alone. SIGINT is left to Python: Ctrl-C raises
    KeyboardInterrupt, and unwinding ends in the atexit hook. If SIGINT has the default action
    (no KeyboardInterrupt), it is handled like SIGTERM.
    """
    global _atexit_installed, _signals_installed, _fork_hook_installed, _mp_finalizer_pid
    with _lock:
        if not _atexit_installed:
            atexit.register(_at_exit)
            _atexit_installed = True
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None and _mp_finalizer_pid != os.getpid():
            # forked multiprocessing children end in os._exit, so atexit never runs there; their
            # exit does run multiprocessing's finalizers (registered per process: fork clears them)
            mp_util.Finalize(None, _at_exit, exitpriority=100)
            _mp_finalizer_pid = os.getpid()
        if not _fork_hook_installed:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook_installed = True
        if _signals_installed or threading.current_thread() is not threading.main_thread():
            return
        candidates = list(TERMINATING_SIGNALS)
        if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:
            candidates.append(signal.SIGINT)
        for signum in candidates:
            current = signal.getsignal(signum)
            if current == signal.SIG_IGN or current is _on_signal:
                continue
            _previous[signum] = current if current is not None else signal.SIG_DFL
            signal.signal(signum, _on_signal)
        _signals_installed = True


def uninstall_signal_handlers() -> None:
    """Put back the handlers that were there before :func:`install` (tests, embedding apps)."""
    global _signals_installed
    with _lock:
        for signum, previous in list(_previous.items()):
            if signal.getsignal(signum) is _on_signal:
                signal.signal(signum, previous)
            del _previous[signum]
        _signals_installed = False
