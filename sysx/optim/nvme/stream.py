"""Bounded-memory sequential access to state files through the tier's I/O engine.

Checkpoints read each tensor's bytes out of a state file and write restored state back into it.
:class:`StateStream` does both through one page-aligned staging buffer of two slots of
``chunk_bytes`` (plus a page each, for an unaligned start): a save or a restore holds that much
extra host memory whatever the size of a stage. Spans need not be aligned; the engine's reads and writes always are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from sysx.memory.pinned import PinnedStaging
from sysx.optim.nvme.io import ALIGN, IoEngine, aligned_nbytes

CHUNK_BYTES = 8 << 20

#: ``fill(start, view)``: put the file's bytes ``start .. start + len(view)`` into ``view``.
Fill = Callable[[int, memoryview], None]


class StateStream:
    """Reads spans of state files piece by piece and writes whole state files chunk by chunk, with
    two slots: the engine moves one chunk while the caller uses the other."""

    def __init__(self, engine: IoEngine, *, chunk_bytes: int = CHUNK_BYTES, pin: bool | None = None) -> None:
        """``pin``: page-lock the staging buffer (a job on a GPU); None: when CUDA is present."""
        self.engine = engine
        self.chunk_bytes = aligned_nbytes(max(chunk_bytes, ALIGN))
        self._slot_bytes = self.chunk_bytes + ALIGN  # a page more for an unaligned start
        self._staging = PinnedStaging(2 * self._slot_bytes, label="checkpoint staging buffer", pin=pin)

    @property
    def staging_bytes(self) -> int:
        """The host memory this stream holds (its one staging buffer)."""
        return self._staging.nbytes

    def _slot(self, i: int, length: int) -> torch.Tensor:
        return self._staging.view(torch.uint8, length, byte_offset=(i % 2) * self._slot_bytes)

    def read_span(self, path: str, offset: int, nbytes: int) -> Iterator[memoryview]:
        """The bytes ``offset .. offset + nbytes`` of ``path``, in pieces of at most ``chunk_bytes``
        (plus a page); each piece is valid until the next is asked for."""
        windows = []
        pos, end = offset, offset + nbytes
        while pos < end:
            start = pos // ALIGN * ALIGN
            length = min(aligned_nbytes(end) - start, self._slot_bytes)
            take = min(end, start + length) - pos
            windows.append((start, length, pos - start, take))
            pos += take
        pending: Future[None] | None = None
        try:
            for i, (start, length, skip, take) in enumerate(windows):
                if pending is None:
                    pending = self.engine.read(path, self._slot(i, length), offset=start)
                pending.result()
                pending = None
                if i + 1 < len(windows):  # the next window loads while the caller uses this one
                    nxt_start, nxt_length = windows[i + 1][:2]
                    pending = self.engine.read(path, self._slot(i + 1, nxt_length), offset=nxt_start)
                yield self._slot(i, length).numpy().data[skip : skip + take]
        finally:
            if pending is not None:  # the caller stopped early: no read may land in a reused slot later
                with contextlib.suppress(Exception):
                    pending.result()

    def write_file(self, path: str, nbytes: int, fill: Fill, *, offset: int = 0) -> None:
        """Write ``aligned_nbytes(nbytes)`` bytes of ``path`` from ``offset`` (a multiple of ``ALIGN``)
        chunk by chunk, each filled by ``fill(start, view)`` with ``start`` counted from ``offset``; the
        bytes from ``nbytes`` to the aligned end are zero."""
        total = aligned_nbytes(nbytes)
        writes: list[Future[None] | None] = [None, None]
        try:
            for i, start in enumerate(range(0, total, self.chunk_bytes)):
                slot = writes[i % 2]
                if slot is not None:
                    slot.result()  # this slot's previous chunk is on disk: reuse it
                length = min(self.chunk_bytes, total - start)
                chunk = self._slot(i, length)
                data = min(length, max(0, nbytes - start))
                if data < length:
                    chunk[data:].zero_()
                if data:
                    fill(start, chunk.numpy().data[:data])
                writes[i % 2] = self.engine.write(path, chunk, offset=offset + start)
        finally:
            for slot in writes:
                if slot is not None:
                    slot.result()

    def close(self) -> None:
        """Free the staging buffer (no piece of a read may be alive)."""
        self._staging.close()

    def __enter__(self) -> StateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
