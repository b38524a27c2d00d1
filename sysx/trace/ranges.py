"""NVTX ranges for Nsight Systems: ``with nvtx_range("OPT s5.1"): ...``.

Off by default (a no-op costing one flag check); on with ``profile.nvtx=true`` (the trainers call
:func:`enable`) or when ``SYSX_NVTX=1`` is in the environment. Uses the ``nvtx`` package, which
works with or without a GPU (unlike ``torch.cuda.nvtx``), so ranges also appear for CPU threads
such as the optimizer workers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_enabled = os.environ.get("SYSX_NVTX", "0") == "1"


def enable(on: bool = True) -> None:
    """Turn NVTX ranges on or off for this process (e.g. from the ``profile.nvtx`` config)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    """True when :func:`nvtx_range` emits ranges."""
    return _enabled


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """An NVTX push/pop range named ``name`` around the block, when enabled."""
    if not _enabled:
        yield
        return
    import nvtx

    with nvtx.annotate(name, domain="sysx"):
        yield
