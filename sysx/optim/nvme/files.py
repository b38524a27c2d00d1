"""The per-rank scratch directory of the NVMe tier's state files: named, reserved, removed.

A rank's directory is ``<optim.nvme_dir>/sysx-<user>-<job>-<node>-nvme.r<rank>``: the same four-part
name as the shared-memory segments (:mod:`sysx.memory.names`), so another job never mistakes it for
its own. Its ``owner.json`` records the creator's pid, start time and host; the status rules and
the liveness test are those of the segments (:func:`sysx.memory.cleanup.classify`,
:func:`sysx.memory.procinfo.is_alive`).

The files are scratch: removed by :meth:`StateDir.close`, on exceptions that unwind through a
``with``, on normal exit, Ctrl-C and SIGTERM/SIGHUP (the segments' exit hooks,
:func:`sysx.memory.cleanup.register_exit_hook`), and otherwise (SIGKILL, a crashed node) by the next
job's start in the same directory or ``sysx nvme clean <dir>``. :meth:`StateDir.reserve` allocates
every file before training (``posix_fallocate``), so a full disk is one :class:`DiskFull` line then,
not an I/O error mid-step.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

from sysx.memory import cleanup, procinfo
from sysx.memory.budget import fmt_bytes
from sysx.memory.names import SegmentName, segment_name, user_entries
from sysx.optim.nvme.io import aligned_nbytes

MARKER = "owner.json"
WHAT_PREFIX = "nvme.r"
_FILE_RE = re.compile(r"^[A-Za-z0-9_.]+$")


class DiskFull(OSError):
    """The state files do not fit on ``optim.nvme_dir``'s file system."""


def disk_full(directory: str, needed: int, free: int) -> DiskFull:
    """The one line a full disk gives, with the fix."""
    return DiskFull(
        errno.ENOSPC,
        f"optim.nvme_dir={directory}: this rank's optimizer state files need {fmt_bytes(needed)} but the file "
        f"system has {fmt_bytes(free)} free; fix: point optim.nvme_dir at a disk with more space, free space there, "
        "or set optim.offload=host",
    )


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged user may still allocate on ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _allocated(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


class StateDir:
    """This rank's directory of state files under ``root`` (``optim.nvme_dir``).

    Creating one first removes this user's stale state directories under ``root`` (their creator
    is dead), then makes the directory (mode 0700) with its owner record.
    """

    def __init__(self, root: str, *, job: str, node: int | str, rank: int, user: str | None = None) -> None:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"optim.nvme_dir={root!r} is not a directory; create it or point it at one")
        self.root = os.path.abspath(root)
        self.name = segment_name(f"{WHAT_PREFIX}{rank}", job=job, node=node, user=user)
        self.path = os.path.join(self.root, self.name.name.lstrip("/"))
        self.sizes: dict[str, int] = {}
        sweep_state_dirs(self.root, user=self.name.user)
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            info = inspect_state_dir(self.path)
            raise FileExistsError(
                f"{self.path} exists ({info.status if info else 'not a sysx state directory'}): job {job!r} rank "
                f"{rank} already runs here; give this job another job id (SYSX_JOB_ID) or stop the other one"
            ) from None
        self._pid, started = procinfo.self_identity()
        owner = {"pid": self._pid, "start": started, "host": socket.gethostname(), "created": time.time()}
        tmp = os.path.join(self.path, MARKER + ".tmp")
        with open(tmp, "w") as f:
            json.dump(owner, f)
        os.replace(tmp, os.path.join(self.path, MARKER))
        self._closed = False
        cleanup.register_exit_hook(self.close)

    def file(self, name: str) -> str:
        """The path of state file ``name`` (``[A-Za-z0-9_.]+``)."""
        if not _FILE_RE.match(name) or name == MARKER:
            raise ValueError(f"state file name {name!r} must match [A-Za-z0-9_.]+ and not be {MARKER}")
        return os.path.join(self.path, name)

    def reserve(self, sizes: Mapping[str, int]) -> dict[str, str]:
        """Allocate every file of ``sizes`` (name -> bytes, rounded up to ``ALIGN``) before training;
        returns name -> path. Raises :class:`DiskFull` (removing what it allocated) when they do not fit."""
        aligned = {name: aligned_nbytes(n) for name, n in sizes.items()}
        paths = {name: self.file(name) for name in aligned}
        needed = sum(max(0, aligned[n] - _allocated(paths[n])) for n in aligned)
        free = free_bytes(self.root)
        if needed > free:
            raise disk_full(self.root, needed, free)
        made: list[str] = []
        try:
            for name, nbytes in aligned.items():
                if not os.path.exists(paths[name]):
                    made.append(paths[name])
                fd = os.open(paths[name], os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                    if os.fstat(fd).st_size > nbytes:
                        os.ftruncate(fd, nbytes)
                finally:
                    os.close(fd)
        except OSError as exc:
            for path in made:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full(self.root, needed, free_bytes(self.root)) from None
            raise
        self.sizes.update(aligned)
        return paths

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the files reserved so far."""
        return sum(self.sizes.values())

    def close(self) -> None:
        """Remove the directory and its files (idempotent; only the creating process removes it)."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        cleanup.unregister_exit_hook(self.close)
        shutil.rmtree(self.path, ignore_errors=True)

    @property
    def closed(self) -> bool:
        """True once removed."""
        return self._closed

    def __enter__(self) -> StateDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StateDir({self.path}, {len(self.sizes)} files, {fmt_bytes(self.reserved_bytes)})"


# --- leftovers --------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateDirInfo:
    """One sysx state directory found under an ``optim.nvme_dir``."""

    path: str
    parsed: SegmentName
    owner: Owner | None
    size: int
    ino: int
    status: str  # alive | stale | creating | broken | elsewhere (created on another host)

    @property
    def removable(self) -> bool:
        """True when nobody can be using it any more."""
        return self.status in ("stale", "broken")


@dataclass(frozen=True)
class Owner:
    """The creator of a state directory, from its ``owner.json``."""

    pid: int
    start: int  # clock ticks since boot (procinfo.start_time): a pid alone may be reused
    host: str

    @property
    def alive(self) -> bool:
        """True while the creator runs (only meaningful on its own host)."""
        return self.host == socket.gethostname() and procinfo.is_alive(self.pid, self.start)


def read_owner(path: str) -> tuple[Owner | None, str | None]:
    """The owner record of state directory ``path`` and, when it is unreadable, why."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            raw = json.load(f)
        return Owner(int(raw["pid"]), int(raw["start"]), str(raw["host"])), None
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"unreadable {MARKER}: {exc}"


def inspect_state_dir(path: str) -> StateDirInfo | None:
    """What ``path`` is, or None when it is not a sysx state directory of this user."""
    parsed = SegmentName.parse(os.path.basename(path))
    if parsed is None or not parsed.what.startswith(WHAT_PREFIX):
        return None
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
        return None
    owner, error = read_owner(path)
    size = sum(_allocated(e.path) for e in os.scandir(path) if e.is_file(follow_symlinks=False))
    if owner is not None and owner.host != socket.gethostname():
        status = "elsewhere"  # a shared file system: its creator's liveness cannot be seen from here
    else:
        alive = owner is not None and owner.alive
        status = cleanup.classify(owner, alive, [], time.time() - st.st_mtime, error)
    return StateDirInfo(path, parsed, owner, size, st.st_ino, status)


def scan_state_dirs(root: str, *, user: str | None = None, job: str | None = None) -> list[StateDirInfo]:
    """This user's sysx state directories directly under ``root``, sorted by name."""
    found = []
    for path, _ in user_entries(root, user=user, job=job):
        info = inspect_state_dir(path)
        if info is not None:
            found.append(info)
    return found


def remove_state_dir(info: StateDirInfo) -> bool:
    """Remove the directory ``info`` describes, unless the name now points at another one."""
    try:
        if os.stat(info.path, follow_symlinks=False).st_ino != info.ino:
            return False
    except FileNotFoundError:
        return False
    shutil.rmtree(info.path, ignore_errors=True)
    return not os.path.exists(info.path)


def sweep_state_dirs(root: str, *, user: str | None = None) -> list[StateDirInfo]:
    """Remove this user's stale and broken state directories under ``root``; returns what was removed."""
    return [info for info in scan_state_dirs(root, user=user) if info.removable and remove_state_dir(info)]
