"""A short disk bandwidth probe through the tier's own I/O engine, for planning.

:func:`measure_disk` writes and reads back a few hundred MB in ``optim.nvme_dir`` with the engine
the tier would use, several requests in flight as the tier keeps them, and returns a small
:class:`DiskProfile`; caching it with the hardware profile is the caller's job. With buffered I/O
(``direct`` False) the read figure is the page cache's, not the disk's: planning should treat it
as an upper bound.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sysx.memory.pinned import PinnedStaging
from sysx.optim.nvme.engine import open_engine
from sysx.optim.nvme.files import free_bytes
from sysx.optim.nvme.io import aligned_nbytes

PROBE_BYTES = 256 << 20
REQUEST_BYTES = 32 << 20  # one request, about a small stage's m or v
IN_FLIGHT = 4


@dataclass(frozen=True)
class DiskProfile:
    """What the probe measured in one directory."""

    read_Bps: float
    write_Bps: float
    direct: bool  # O_DIRECT in use (False: buffered, the read figure is the page cache's)
    engine: str  # "aio" | "threads"
    free_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for a JSON cache."""
        return asdict(self)


def _timed(submit: Any, path: str, views: list[torch.Tensor], count: int, request: int) -> float:
    """Seconds to move ``count`` requests with ``len(views)`` in flight."""
    t0 = time.perf_counter()
    pending: list[Any] = []
    for i in range(count):
        if len(pending) == len(views):
            pending.pop(0).result()
        pending.append(submit(path, views[i % len(views)], offset=i * request))
    for future in pending:
        future.result()
    return time.perf_counter() - t0


def measure_disk(
    directory: str,
    nbytes: int = PROBE_BYTES,
    *,
    engine: str = "auto",
    request_bytes: int = REQUEST_BYTES,
    in_flight: int = IN_FLIGHT,
) -> DiskProfile:
    """Write then read ``nbytes`` (rounded to whole requests) in ``directory``; the probe file is
    removed afterwards whatever happens."""
    request = aligned_nbytes(min(request_bytes, nbytes))
    count = max(1, -(-nbytes // request))
    io = open_engine(engine, directory)
    staging = [PinnedStaging(request, label="disk probe buffer") for _ in range(min(in_flight, count))]
    views = [s.view(torch.uint8, request).fill_(0x5A) for s in staging]
    path = os.path.join(directory, f".sysx-disk-probe-{os.getpid()}")
    try:
        t0 = time.perf_counter()
        _timed(io.write, path, views, count, request)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # buffered I/O: the write figure includes reaching the disk
        finally:
            os.close(fd)
        write_s = max(time.perf_counter() - t0, 1e-9)
        read_s = max(_timed(io.read, path, views, count, request), 1e-9)
        total = count * request
        return DiskProfile(total / read_s, total / write_s, io.direct, io.name, free_bytes(directory))
    finally:
        io.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        views.clear()
        for s in staging:
            s.close()
