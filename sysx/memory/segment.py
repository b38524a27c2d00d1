"""One POSIX shared-memory segment: header, exact-size allocation, create/attach/close/unlink.

Layout: a header page (header.py: magic, version, state CREATING/READY/CLOSING, creator, JSON
meta), then ``data_bytes`` of payload (nothing rounded up).

Lifetime protocol: every process that maps a segment (owner and attachers) holds a shared
``flock`` on it for as long as it maps it; the kernel drops the lock when the process exits, even
by SIGKILL. The owner unlinks exactly once: it marks the header CLOSING, waits until it can take
the lock exclusively (every attacher detached or died; bounded by a timeout), then unlinks.
Attachers never unlink. Locks also tell ``sysx shm list`` whether anyone still uses a segment.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import struct
import time
import warnings
from typing import TYPE_CHECKING, Any

import posix_ipc

from sysx.memory import budget, cleanup, procinfo
from sysx.memory.header import (
    HEADER_BYTES,
    LAYOUT_VERSION,
    STATE_CLOSING,
    STATE_CREATING,
    STATE_OFFSET,
    STATE_READY,
    Header,
    SegmentError,
    read_header,
    segment_bytes,
)
from sysx.memory.names import SHM_DIR, SegmentName
from sysx.memory.views import MappedBuffer, dtype_itemsize

if TYPE_CHECKING:
    import torch

MODE = 0o600


class SegmentExistsError(SegmentError, FileExistsError):
    """The name is taken by a segment whose creator is still alive."""


class SegmentNotFoundError(SegmentError, FileNotFoundError):
    """No segment of that name appeared before the attach timeout."""


class StaleSegmentError(SegmentError):
    """The segment was left behind by a process that no longer exists."""


def _other_users(fd: int) -> bool:
    """True when a process other than this one holds the segment's lock (maps it). Holders in
    another pid namespace count (the creator may be alive there even if its pid is not visible)."""
    st = os.fstat(fd)
    holders = procinfo.lock_holders(st.st_dev, st.st_ino)
    if holders is None:
        return False
    if os.getpid() in holders:
        holders.remove(os.getpid())  # our own fresh lock
    return bool(holders)


def _same_file(path: str, fd: int) -> bool:
    """True when ``path`` still names the file open as ``fd`` (guards against unlinking a new
    segment that reused the name)."""
    try:
        a, b = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class Segment:
    """A mapped sysx segment. Build with :meth:`create` (owner) or :meth:`attach` (others)."""

    def __init__(
        self, name: SegmentName, shm: posix_ipc.SharedMemory, header: Header, mm: mmap.mmap, *, owner: bool
    ) -> None:
        self.name = name
        self._shm: posix_ipc.SharedMemory | None = shm
        self._fd = shm.fd
        self.header = header
        self.is_owner = owner
        self.buffer = MappedBuffer(mm, f"segment {name.name}")
        self.unlinked = False
        self._pid = os.getpid()

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        name: SegmentName,
        data_bytes: int,
        *,
        meta: dict[str, Any] | None = None,
        check_space: bool = True,
        register: bool = True,
    ) -> Segment:
        """Create ``name`` with exactly ``data_bytes`` of payload, mode 0600, memory reserved up
        front (``posix_fallocate``), and register it for unlinking on every exit path.

        Free ``/dev/shm`` is checked before anything is allocated. A stale segment of the same name
        (creator dead, nobody mapping it) is replaced; a live one raises :class:`SegmentExistsError`.
        """
        if data_bytes <= 0:
            raise ValueError(f"segment {name.name}: data_bytes must be positive, got {data_bytes}")
        total = segment_bytes(data_bytes)
        if check_space:
            budget.check_shm_request(total, what=f"segment {name.name}")
        pid, started = procinfo.self_identity()
        header = Header(LAYOUT_VERSION, HEADER_BYTES, STATE_CREATING, pid, started, data_bytes, time.time(), meta or {})
        packed = header.pack()
        shm = cls._open_exclusive(name)
        try:
            fcntl.flock(shm.fd, fcntl.LOCK_SH)
            os.fchmod(shm.fd, MODE)  # exact mode whatever the umask
            _reserve(shm.fd, total, name.name)
            mm = mmap.mmap(shm.fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.pwrite(shm.fd, packed, 0)
            os.pwrite(shm.fd, struct.pack("<I", STATE_READY), STATE_OFFSET)
        except BaseException:
            _unlink_quietly(name.name)
            shm.close_fd()
            raise
        segment = cls(name, shm, _replace_state(header, STATE_READY), mm, owner=True)
        if register:
            cleanup.register_owned(segment)
        return segment

    @staticmethod
    def _open_exclusive(name: SegmentName) -> posix_ipc.SharedMemory:
        for _ in range(2):
            try:
                return posix_ipc.SharedMemory(name.name, posix_ipc.O_CREX, mode=MODE, size=0)
            except posix_ipc.ExistentialError:
                info = cleanup.inspect(name.path)
                if info is None:
                    continue  # vanished meanwhile: try again
                if info.status in ("stale", "broken"):
                    warnings.warn(
                        f"sysx: replacing stale shared-memory segment {name.name} left by pid {info.creator_pid} "
                        f"({info.status}, {info.size} bytes)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    cleanup.remove(info)
                    continue
                if info.creator_pid == os.getpid():
                    raise SegmentExistsError(
                        f"{name.name} was already created by this process; close it before creating it again"
                    ) from None
                raise SegmentExistsError(
                    f"shared-memory segment {name.name} already exists and is {info.status} "
                    f"(creator pid {info.creator_pid}, users {info.holders}): another sysx job with job id "
                    f"{name.job!r} is running on this node. Give this job another id (SYSX_JOB_ID=...) or stop "
                    "the other one; `sysx shm list` shows all segments"
                ) from None
        raise SegmentExistsError(
            f"shared-memory segment {name.name} keeps reappearing; is another job racing for this name?"
        )

    @classmethod
    def attach(cls, name: SegmentName, *, timeout_s: float = 60.0, register: bool = True) -> Segment:
        """Map the segment another process created, waiting up to ``timeout_s`` for it to be ready.

        Raises :class:`SegmentNotFoundError` when it never appears, :class:`StaleSegmentError` when
        its creator is dead, :class:`SegmentError` when its owner is closing it.
        """
        deadline = time.monotonic() + timeout_s
        delay = 0.005
        last = "it does not exist"
        while True:
            shm = None
            try:
                shm = posix_ipc.SharedMemory(name.name, 0)
                fcntl.flock(shm.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                header = read_header(shm.fd, name.name)
                if header is not None and header.state == STATE_READY:
                    if not header.creator_alive and not _other_users(shm.fd):
                        raise StaleSegmentError(
                            f"{name.name} was left behind by pid {header.creator_pid}, which is dead: its data is stale. "
                            "Restart the job (the new owner replaces it) or run `sysx shm clean`"
                        )
                    total = segment_bytes(header.data_bytes)
                    mm = mmap.mmap(shm.fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                    segment = cls(name, shm, header, mm, owner=False)
                    if register:
                        cleanup.register_attached(segment)
                    return segment
                if header is not None and header.state == STATE_CLOSING:
                    raise SegmentError(
                        f"{name.name} is being closed by its owner (pid {header.creator_pid}); it cannot be attached now"
                    )
                last = "it is still being created"
            except posix_ipc.ExistentialError:
                last = "it does not exist"
            except BlockingIOError:
                last = "its owner holds it exclusively (closing)"
            except BaseException:
                if shm is not None:
                    shm.close_fd()
                raise
            if shm is not None:
                shm.close_fd()
            if time.monotonic() >= deadline:
                raise SegmentNotFoundError(
                    f"could not attach {name.name} within {timeout_s:.0f} s: {last}. Is the owning rank running and "
                    "using the same job id and node? (`sysx shm list` shows the segments of this node)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    # -- use ----------------------------------------------------------------------------------
    @property
    def data_bytes(self) -> int:
        """Payload size in bytes."""
        return self.header.data_bytes

    @property
    def data_address(self) -> int:
        """Virtual address of the first payload byte in this process."""
        return self.buffer.address + self.header.header_bytes

    def tensor(self, dtype: Any, byte_offset: int, numel: int) -> torch.Tensor:
        """A flat tensor over ``numel`` elements of ``dtype`` at ``byte_offset`` into the payload
        (zero copy, contiguous)."""
        if byte_offset + numel * dtype_itemsize(dtype) > self.data_bytes:
            raise ValueError(
                f"{self.name.name}: view of {numel} x {dtype} at {byte_offset} exceeds the {self.data_bytes}-byte payload"
            )
        return self.buffer.tensor(dtype, self.header.header_bytes + byte_offset, numel)

    @property
    def closed(self) -> bool:
        """True once the mapping is gone."""
        return self._shm is None

    # -- teardown ----------------------------------------------------------------------------
    def mark_closing(self) -> None:
        """Owner only: set the header to CLOSING so no new process attaches (first step of release)."""
        if not self.is_owner:
            raise SegmentError(
                f"{self.name.name}: only the owner (pid {self.header.creator_pid}) unlinks; attachers call close()"
            )
        if not self.unlinked and self._shm is not None:
            os.pwrite(self._fd, struct.pack("<I", STATE_CLOSING), STATE_OFFSET)

    def release(self, timeout_s: float = 30.0, *, deadline: float | None = None) -> bool:
        """Owner only: mark CLOSING, wait until every attacher detached (or died), unlink once.

        Waits until ``deadline`` (``time.monotonic()``; several segments can share one) or
        ``timeout_s`` from now. Returns True when all attachers had detached, False when time ran
        out first (the name is unlinked anyway; their mappings stay valid). Safe to call again.
        """
        self.mark_closing()
        if self.unlinked or self._shm is None:
            return True
        deadline = time.monotonic() + timeout_s if deadline is None else deadline
        detached = False
        delay = 0.002
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                detached = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        if not detached:
            st = os.fstat(self._fd)
            warnings.warn(
                f"sysx: {self.name.name} still mapped by pid(s) {procinfo.lock_holders(st.st_dev, st.st_ino)} when "
                "the detach timeout (SYSX_SHM_DETACH_TIMEOUT) ran out; unlinking the name anyway (their mappings stay valid)",
                RuntimeWarning,
                stacklevel=2,
            )
        if _same_file(self.name.path, self._fd):
            _unlink_quietly(self.name.name)
        self.unlinked = True
        cleanup.unregister(self)
        return detached

    def close(self, timeout_s: float = 30.0, *, deadline: float | None = None) -> None:
        """Unmap. The owner also releases (waits for attachers, unlinks); an attacher only detaches.

        Raises :class:`~sysx.memory.views.LiveViewsError` and changes nothing while tensors still
        view the segment.
        """
        if self._shm is None:
            return
        self.buffer.close()  # raises first if views are alive
        if self.is_owner and os.getpid() == self._pid:
            self.release(timeout_s, deadline=deadline)
        self._shm.close_fd()  # drops this process's lock
        self._shm = None
        cleanup.unregister(self)

    def detach_lock(self) -> None:
        """Attacher exit path: stop counting as a user (drop the lock) but keep the mapping, so live
        tensors stay valid while the owner unlinks."""
        if not self.is_owner and self._shm is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def unlink(self) -> None:
        """Owner only: remove the name now without waiting for attachers (mappings stay valid)."""
        self.release(timeout_s=0.0)

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else "attached"
        return f"Segment({self.name.name}, {self.data_bytes} bytes, {role}{', closed' if self.closed else ''})"


def _replace_state(header: Header, state: int) -> Header:
    return Header(
        header.layout_version,
        header.header_bytes,
        state,
        header.creator_pid,
        header.creator_start,
        header.data_bytes,
        header.created_unix,
        header.meta,
    )


def _reserve(fd: int, total: int, name: str) -> None:
    """Allocate every page now so a shortage is an error here, not a SIGBUS later."""
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            free = budget.shm_free_bytes()
            raise budget.ShmBudgetError(
                f"could not reserve {budget.fmt_bytes(total)} for shared-memory segment {name}: "
                f"{os.strerror(exc.errno)} ({budget.fmt_bytes(free)} free in {SHM_DIR} now).\n"
                + budget.shm_fix_hint(total)
            ) from None
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            warnings.warn(
                f"sysx: posix_fallocate unsupported on {SHM_DIR} ({exc}); a later shortage may SIGBUS",
                RuntimeWarning,
                stacklevel=3,
            )
            os.ftruncate(fd, total)
            return
        raise


def _unlink_quietly(name: str) -> None:
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(name)
