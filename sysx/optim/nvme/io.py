"""The I/O engine of the NVMe tier: whole-buffer reads and writes of state files, each a Future.

Two engines share one interface (:class:`IoEngine`): ``aio`` (DeepSpeed's ``async_io`` op, the
libaio engine ZeRO-Infinity uses; :mod:`sysx.optim.nvme.aio`) and ``threads`` (``os.preadv`` /
``os.pwritev`` on a few threads, here). Both open files with ``O_DIRECT`` so state bytes bypass the
page cache (they would otherwise take the very host memory the tier frees); where the file system
refuses ``O_DIRECT`` (tmpfs, some network file systems) the threads engine does buffered I/O and
one warning line names the directory.

Buffers must start on a page and hold a multiple of :data:`ALIGN` bytes (``O_DIRECT``'s rule, kept
in buffered mode too so a run behaves the same on every file system): allocate them with
:class:`sysx.memory.pinned.PinnedStaging` sized by :func:`aligned_nbytes`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

ALIGN = 4096  # O_DIRECT needs the logical block size (512 or 4096); a page covers both
BLOCK_BYTES = 8 << 20  # one preadv/pwritev call of the threads engine
DEFAULT_THREADS = 4


class IoError(OSError):
    """A read or write of a state file failed; the message names the file, the bytes and errno."""


def aligned_nbytes(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN` (the size of a state file and its buffer)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return -(-nbytes // ALIGN) * ALIGN


class IoEngine(Protocol):
    """What the tier uses of an engine. ``read``/``write`` return at once; the Future completes
    (or raises :class:`IoError`) when the bytes are in ``buf`` / in the file."""

    name: str
    direct: bool

    def read(self, path: str, buf: torch.Tensor, *, offset: int = 0) -> Future[None]: ...

    def write(self, path: str, buf: torch.Tensor, *, offset: int = 0) -> Future[None]: ...

    def close(self) -> None: ...


def check_buffer(buf: torch.Tensor, offset: int, path: str) -> int:
    """The byte count of ``buf`` after checking the alignment rule; raises ValueError naming the fix."""
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError(f"{path}: the I/O buffer must be a contiguous host tensor, got {buf.device} {buf.shape}")
    nbytes = buf.numel() * buf.element_size()
    if buf.data_ptr() % ALIGN or nbytes % ALIGN or offset % ALIGN or nbytes == 0:
        raise ValueError(
            f"{path}: I/O buffer at 0x{buf.data_ptr():x} of {nbytes} bytes, file offset {offset}: address, size and "
            f"offset must be non-zero multiples of {ALIGN} (allocate with PinnedStaging(aligned_nbytes(n)))"
        )
    return nbytes


def io_error(op: str, path: str, nbytes: int, offset: int, exc: OSError) -> IoError:
    """One line naming the operation, file, bytes and errno."""
    code = exc.errno or errno.EIO
    return IoError(
        code, f"{op} of {nbytes} bytes at offset {offset} of {path} failed: errno {code} ({os.strerror(code)})"
    )


def short_read_error(path: str, nbytes: int, offset: int, got: int) -> IoError:
    """A read that reached the end of the file before ``nbytes``."""
    return IoError(
        errno.EIO,
        f"short read of {path}: wanted {nbytes} bytes at offset {offset}, the file ended after {got} "
        "(a truncated or foreign state file; errno EIO)",
    )


def _memory(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def probe_direct(directory: str) -> bool:
    """True when ``directory``'s file system accepts an ``O_DIRECT`` open, write and read."""
    path = os.path.join(directory, f".sysx-direct-probe-{os.getpid()}-{threading.get_ident()}")
    page = mmap.mmap(-1, ALIGN)  # page aligned
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    try:
        with memoryview(page) as view:
            os.pwritev(fd, [view], 0)
            os.preadv(fd, [view], 0)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        page.close()


def direct_refused_warning(directory: str) -> None:
    """The one warning line for a file system without ``O_DIRECT``."""
    warnings.warn(
        f"sysx: {directory} refuses O_DIRECT (tmpfs or a network file system?): the NVMe tier uses buffered I/O "
        "there, so the page cache holds state bytes and takes host memory; point optim.nvme_dir at a local NVMe "
        "file system (ext4, xfs) for direct I/O",
        RuntimeWarning,
        stacklevel=3,
    )


class _Gather:
    """Completes one op's Future when its last block is done (with the first block's error, if any)
    and closes the op's file descriptor."""

    def __init__(self, blocks: int, fd: int, done: Future[None]) -> None:
        self._left = blocks
        self._fd = fd
        self._done = done
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def block_done(self, block: Future[None]) -> None:
        with self._lock:
            self._left -= 1
            if self._error is None:
                self._error = block.exception()
            if self._left:
                return
        os.close(self._fd)
        if self._error is not None:
            self._done.set_exception(self._error)
        else:
            self._done.set_result(None)


class ThreadsEngine:
    """``os.preadv``/``os.pwritev`` on ``threads`` workers; each op is cut into :data:`BLOCK_BYTES`
    blocks spread over the workers, so one large read keeps several requests in flight."""

    name = "threads"

    def __init__(self, *, direct: bool, threads: int = DEFAULT_THREADS, block_bytes: int = BLOCK_BYTES) -> None:
        if block_bytes % ALIGN:
            raise ValueError(f"block_bytes={block_bytes} must be a multiple of {ALIGN}")
        self.direct = direct
        self.block_bytes = block_bytes
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="sysx-nvme-io")

    def _flags(self, write: bool) -> int:
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        return flags | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)

    def read(self, path: str, buf: torch.Tensor, *, offset: int = 0) -> Future[None]:
        """Read ``buf.nbytes`` bytes of ``path`` from ``offset`` into ``buf``."""
        return self._submit("read", path, buf, offset)

    def write(self, path: str, buf: torch.Tensor, *, offset: int = 0) -> Future[None]:
        """Write ``buf``'s bytes into ``path`` at ``offset`` (created if missing, never truncated:
        a reserved file keeps its blocks)."""
        return self._submit("write", path, buf, offset)

    def _submit(self, op: str, path: str, buf: torch.Tensor, offset: int) -> Future[None]:
        done: Future[None] = Future()
        nbytes = check_buffer(buf, offset, path)
        try:
            fd = os.open(path, self._flags(op == "write"), 0o600)
        except OSError as exc:
            done.set_exception(io_error(op, path, nbytes, offset, exc))
            return done
        blocks = [(start, min(self.block_bytes, nbytes - start)) for start in range(0, nbytes, self.block_bytes)]
        gather = _Gather(len(blocks), fd, done)
        address = buf.data_ptr()
        for start, length in blocks:
            work = self._pool.submit(
                self._block, op, fd, path, _memory(address + start, length), offset + start, buf, nbytes, offset
            )
            work.add_done_callback(gather.block_done)
        return done

    @staticmethod
    def _block(
        op: str, fd: int, path: str, view: memoryview, at: int, keep: torch.Tensor, nbytes: int, offset: int
    ) -> None:
        """Move one block, looping over partial transfers; ``keep`` holds the tensor alive meanwhile."""
        moved = 0
        while moved < len(view):
            try:
                if op == "read":
                    n = os.preadv(fd, [view[moved:]], at + moved)
                else:
                    n = os.pwritev(fd, [view[moved:]], at + moved)
            except OSError as exc:
                raise io_error(op, path, nbytes, offset, exc) from None
            if n == 0:
                got = at + moved - offset
                raise (
                    short_read_error(path, nbytes, offset, got)
                    if op == "read"
                    else IoError(
                        errno.EIO, f"write of {nbytes} bytes at offset {offset} of {path} made no progress (errno EIO)"
                    )
                )
            moved += n

    def close(self) -> None:
        """Wait for queued blocks, then stop the workers."""
        self._pool.shutdown(wait=True)
