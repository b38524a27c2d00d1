"""Bounded-memory sequential access to state files through the tier's I/O engine.

Checkpoints read each tensor's bytes out of a state file and write restored state back into it.
:class:`StateStream` does both through one page-aligned staging buffer of ``chunk_bytes`` (plus a
page for an unaligned start): a save or a restore holds that much extra host memory whatever the
size of a stage. Spans need not be aligned; the engine's reads and writes always are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from sysx.memory.pinned import PinnedStaging
from sysx.optim.nvme.io import ALIGN, IoEngine, aligned_nbytes

CHUNK_BYTES = 8 << 20

#: ``fill(start, view)``: put the file's bytes ``start .. start + len(view)`` into ``view``.
Fill = Callable[[int, memoryview], None]


class StateStream:
    """Reads spans of state files piece by piece and writes whole state files chunk by chunk."""

    def __init__(self, engine: IoEngine, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.engine = engine
        self.chunk_bytes = aligned_nbytes(max(chunk_bytes, ALIGN))
        self._staging = PinnedStaging(self.chunk_bytes + ALIGN, label="checkpoint staging buffer")

    @property
    def staging_bytes(self) -> int:
        """The host memory this stream holds (its one staging buffer)."""
        return self._staging.nbytes

    def read_span(self, path: str, offset: int, nbytes: int) -> Iterator[memoryview]:
        """The bytes ``offset .. offset + nbytes`` of ``path``, in pieces of at most ``chunk_bytes``;
        each piece is valid until the next is asked for."""
        pos, end = offset, offset + nbytes
        while pos < end:
            start = pos // ALIGN * ALIGN
            length = min(aligned_nbytes(end) - start, self.chunk_bytes + ALIGN)
            window = self._staging.view(torch.uint8, length)
            self.engine.read(path, window, offset=start).result()
            take = min(end, start + length) - pos
            piece = window.numpy().data[pos - start : pos - start + take]
            del window
            yield piece
            pos += take

    def write_file(self, path: str, nbytes: int, fill: Fill) -> None:
        """Write bytes ``0 .. aligned_nbytes(nbytes)`` of ``path`` chunk by chunk, each filled by
        ``fill``; the bytes from ``nbytes`` to the aligned end are zero."""
        total = aligned_nbytes(nbytes)
        for start in range(0, total, self.chunk_bytes):
            length = min(self.chunk_bytes, total - start)
            chunk = self._staging.view(torch.uint8, length)
            data = min(length, max(0, nbytes - start))
            if data < length:
                chunk[data:].zero_()
            if data:
                fill(start, chunk.numpy().data[:data])
            self.engine.write(path, chunk, offset=start).result()
            del chunk

    def close(self) -> None:
        """Free the staging buffer (no piece of a read may be alive)."""
        self._staging.close()

    def __enter__(self) -> StateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
