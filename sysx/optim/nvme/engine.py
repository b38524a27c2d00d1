"""Choosing the I/O engine of the NVMe tier (``optim.nvme_engine``) for a directory."""

from __future__ import annotations

import os
import warnings

from sysx.optim.nvme import aio
from sysx.optim.nvme.io import DEFAULT_THREADS, IoEngine, ThreadsEngine, direct_refused_warning, probe_direct

ENGINES = ("auto", "aio", "threads")


def open_engine(kind: str, directory: str, *, threads: int = DEFAULT_THREADS) -> IoEngine:
    """The engine ``kind`` (``auto`` | ``aio`` | ``threads``) for state files under ``directory``.

    ``auto`` takes ``aio`` when DeepSpeed's op is usable here, else ``threads`` with one warning
    line saying why. Where ``directory`` refuses ``O_DIRECT`` every kind becomes buffered
    ``threads`` (the aio op only does direct I/O), with one warning line.
    """
    if kind not in ENGINES:
        raise ValueError(f"optim.nvme_engine={kind!r}: choose one of {', '.join(ENGINES)}")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"optim.nvme_dir={directory!r} is not a directory; create it or point it at one")
    direct = probe_direct(directory)
    if not direct:
        direct_refused_warning(directory)
        return ThreadsEngine(direct=False, threads=threads)
    if kind == "threads":
        return ThreadsEngine(direct=True, threads=threads)
    if kind == "aio":
        return aio.AioEngine()
    why = aio.unavailable_reason()
    if why is None:
        return aio.AioEngine()
    warnings.warn(
        f"sysx: the NVMe tier uses its threads engine, not DeepSpeed's aio op ({why}); "
        "fix: `apt install libaio-dev` (or optim.nvme_engine=threads to silence this)",
        RuntimeWarning,
        stacklevel=2,
    )
    return ThreadsEngine(direct=True, threads=threads)
