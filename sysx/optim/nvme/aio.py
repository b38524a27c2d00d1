"""The ``aio`` engine: DeepSpeed's ``async_io`` op (libaio, ``O_DIRECT``), the engine ZeRO-Infinity uses.

The op is built on first use into the same per-environment cache as ``cpu_adam``
(:func:`sysx.optim.deepspeed_backend.extensions_dir`, ~2.5 min the first time, then loaded in a
second) with the venv's ``ninja``. Its handle is synchronous per call and not meant to be shared
between threads, so the engine runs one handle on a read lane thread and one on a write lane thread:
a read and a write overlap, and each request gets its own Future.

The op checks little itself (a file shorter than the read ``assert``\\ s inside C++; per-request
results are not checked), so sizes are checked here before each call.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import TYPE_CHECKING, Any

from sysx.optim.nvme.io import IoError, check_buffer, io_error, short_read_error

if TYPE_CHECKING:
    import torch

log = logging.getLogger("sysx.optim")

BLOCK_BYTES = 1 << 20  # DeepSpeed's default aio block and ZeRO-Infinity's usual setting
QUEUE_DEPTH = 32

_lock = threading.Lock()
_op: ModuleType | None = None
_reason: str | None = None
_checked = False


def _build() -> ModuleType:
    from sysx.optim.deepspeed_backend import clear_stale_lock, environment_ninja, extensions_dir, quiet_cpu_accelerator

    quiet_cpu_accelerator()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir())
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise RuntimeError("DeepSpeed's AsyncIOBuilder finds no libaio (io_submit does not link)")
    clear_stale_lock(extensions_dir() / "async_io")
    cached = (extensions_dir() / "async_io" / "async_io.so").exists()
    if not cached:
        log.warning("building DeepSpeed's async_io op into %s (first use, ~2.5 min)", extensions_dir() / "async_io")
    t0 = time.perf_counter()
    with environment_ninja():
        op = builder.load(verbose=False)
    log.info("DeepSpeed async_io op %s in %.1f s", "loaded" if cached else "built", time.perf_counter() - t0)
    return op


def load_op() -> ModuleType:
    """The async_io op (built on first use); raises RuntimeError with the cause and the fix."""
    global _op, _reason, _checked
    with _lock:
        if _op is not None:
            return _op
        if _checked and _reason is not None:
            raise RuntimeError(_reason)
        _checked = True
        try:
            _op = _build()
        except Exception as exc:  # ImportError, a failed compile, no libaio
            _reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise RuntimeError(
                f"DeepSpeed's aio op is unavailable ({_reason}); fix: `apt install libaio-dev`, "
                "or set optim.nvme_engine=threads"
            ) from exc
        return _op


def unavailable_reason() -> str | None:
    """None when the aio op loads here, else one phrase saying why (checked once per process)."""
    try:
        load_op()
    except RuntimeError:
        return _reason
    return None


class AioEngine:
    """One DeepSpeed aio handle per lane (read, write), each on its own thread."""

    name = "aio"
    direct = True

    def __init__(self, *, block_bytes: int = BLOCK_BYTES, queue_depth: int = QUEUE_DEPTH) -> None:
        self._op = load_op()
        self._config = (block_bytes, queue_depth)
        self._local = threading.local()
        self._lanes = {
            op: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sysx-aio-{op}") for op in ("read", "write")
        }

    def _handle(self) -> Any:
        handle = getattr(self._local, "handle", None)
        if handle is None:
            block, depth = self._config
            handle = self._op.aio_handle(block, depth, False, True, 1)
            self._local.handle = handle
        return handle

    def read(self, path: str, buf: torch.Tensor, *, offset: int = 0) -> Future[None]:
        """Read ``buf.nbytes`` bytes of ``path`` from ``offset`` into ``buf``."""
        return self._submit("read", path, buf, offset)

    def write(self, path: str, buf: torch.Tensor, *, offset: int = 0) -> Future[None]:
        """Write ``buf``'s bytes into ``path`` at ``offset`` (created if missing, never truncated)."""
        return self._submit("write", path, buf, offset)

    def _submit(self, op: str, path: str, buf: torch.Tensor, offset: int) -> Future[None]:
        nbytes = check_buffer(buf, offset, path)
        done: Future[None] = Future()
        # the lane gets the tensor in a box it empties: once ``done`` completes, no thread holds a
        # view of the caller's buffer (its owner may free it at once; the executor's own Future
        # completes while its work item still holds the arguments)
        self._lanes[op].submit(self._finish, done, op, path, [buf], nbytes, offset)
        return done

    def _finish(
        self, done: Future[None], op: str, path: str, box: list[torch.Tensor], nbytes: int, offset: int
    ) -> None:
        buf = box.pop()
        try:
            self._run(op, path, buf, nbytes, offset)
        except BaseException as exc:
            del buf
            traceback.clear_frames(exc.__traceback__)  # its frames' locals would hold the tensor
            done.set_exception(exc)
            return
        del buf
        done.set_result(None)

    def _run(self, op: str, path: str, buf: torch.Tensor, nbytes: int, offset: int) -> None:
        if op == "read":
            try:
                size = os.stat(path).st_size
            except OSError as exc:
                raise io_error(op, path, nbytes, offset, exc) from None
            if size < offset + nbytes:
                raise short_read_error(path, nbytes, offset, max(0, size - offset))
            done = self._handle().sync_pread(_alias(buf), path, offset)
        else:
            done = self._handle().sync_pwrite(_alias(buf), path, offset)
        if done != 1:
            raise self._failure(op, path, nbytes, offset)

    @staticmethod
    def _failure(op: str, path: str, nbytes: int, offset: int) -> IoError:
        """The op reports only -1 (its own stderr line has the errno): find the errno by opening the
        file as the op does; EIO when that works."""
        flags = (os.O_WRONLY | os.O_CREAT) if op == "write" else os.O_RDONLY
        try:
            os.close(os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC, 0o600))
        except OSError as exc:
            return io_error(op, path, nbytes, offset, exc)
        return io_error(op, path, nbytes, offset, OSError(errno.EIO, os.strerror(errno.EIO)))

    def close(self) -> None:
        """Finish queued requests and stop both lanes."""
        for lane in self._lanes.values():
            lane.shutdown(wait=True)


def _alias(buf: torch.Tensor) -> torch.Tensor:
    """``buf``'s bytes as a tensor with a storage of its own: the op's threads may let go of the tensor
    they were given a moment after the call returns, and a reference to ``buf``'s own storage would then
    keep its owner's mapping from closing (PinnedStaging.close: LiveViewsError) though no byte is
    touched after the call."""
    import torch

    raw = (ctypes.c_uint8 * buf.nbytes).from_address(buf.data_ptr())
    return torch.frombuffer(raw, dtype=torch.uint8)


def build() -> int:
    """``sysx nvme build-aio``: build (or load) the op once, ahead of a job; 0 when it is ready."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        load_op()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("DeepSpeed's async_io op is ready")
    return 0
