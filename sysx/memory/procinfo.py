"""Process identity for stale-segment detection: a pid plus its start time.

A pid alone is not an identity (pids are reused), so segments record the creator's pid *and* its
start time (field 22 of ``/proc/<pid>/stat``, clock ticks since boot). The creator is alive only
if a process with that pid exists, is not a zombie, and started at that time.
"""

from __future__ import annotations

import os
import re

_LOCK_RE = re.compile(r"^\d+:\s+(\S+)\s+\S+\s+(\S+)\s+(-?\d+)\s+([0-9a-f]+):([0-9a-f]+):(\d+)\s")


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (state is index 0), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name is in parentheses and may itself contain spaces and ')'.
    return raw[raw.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 overall; index 19 after pid and comm


def self_identity() -> tuple[int, int]:
    """(pid, start time) of this process."""
    pid = os.getpid()
    started = start_time(pid)
    if started is None:
        raise RuntimeError(f"cannot read /proc/{pid}/stat: sysx shared memory needs Linux /proc")
    return pid, started


def is_alive(pid: int, started: int) -> bool:
    """True when process ``pid`` exists, is not a zombie, and started at ``started`` (not reused)."""
    if pid <= 0:
        return False
    fields = _stat_fields(pid)
    if fields is None:
        return False
    if fields[0] in ("Z", "X", "x"):
        return False
    return int(fields[19]) == started


def lock_holders(dev: int, ino: int) -> list[int] | None:
    """Pids holding a lock on the file ``(dev, ino)`` according to ``/proc/locks``.

    Every sysx process that maps a segment holds a shared ``flock`` on it, and the kernel drops the
    lock when the process dies (even by SIGKILL), so this is the set of live users. Returns None
    when ``/proc/locks`` cannot be read. A pid of 0 or -1 means a holder in another pid namespace.
    """
    try:
        with open("/proc/locks") as f:
            lines = f.readlines()
    except OSError:
        return None
    major, minor = os.major(dev), os.minor(dev)
    holders: list[int] = []
    for line in lines:
        match = _LOCK_RE.match(line)
        if match is None or match.group(1) != "FLOCK":
            continue
        if (int(match.group(4), 16), int(match.group(5), 16), int(match.group(6))) == (major, minor, ino):
            holders.append(int(match.group(3)))
    return holders


def lock_users(fd: int) -> list[int]:
    """Pids holding a ``flock`` on the open file ``fd`` (:func:`lock_holders`); without
    ``/proc/locks``, ``[-1]`` when a non-blocking exclusive lock is refused (someone holds it), else
    ``[]`` (the probe's lock goes when ``fd`` is closed)."""
    st = os.fstat(fd)
    holders = lock_holders(st.st_dev, st.st_ino)
    if holders is not None:
        return holders
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return [-1]
    return []
