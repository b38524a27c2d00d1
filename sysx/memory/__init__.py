"""Host memory: the shared-memory parameter store, pinned staging buffers, budgets, cleanup.

Importing this package is cheap (no torch): the torch-dependent names (``SharedParamStore``,
``StageSpec``, ``PinnedStaging`` ...) load on first use, so ``sysx shm list`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from sysx.memory.budget import (
    HostCapacity,
    HostMemoryError,
    HostMemoryPlan,
    ShmBudgetError,
    check_shm_request,
    plan_host_memory,
    probe_host,
    remove_ipc_warning,
)
from sysx.memory.cleanup import SegmentInfo, release_all, scan, sweep_lock, sweep_stale
from sysx.memory.header import SegmentError
from sysx.memory.names import SegmentName, mpi_broadcast, resolve_job_id, segment_name, torch_broadcast
from sysx.memory.segment import Segment, SegmentExistsError, SegmentNotFoundError, StaleSegmentError
from sysx.memory.views import LiveViewsError, drop_failure_views

_LAZY = {
    "SharedParamStore": "sysx.memory.store",
    "StageSpec": "sysx.memory.store",
    "StageBuffers": "sysx.memory.store",
    "MirrorPush": "sysx.memory.store",
    "PinnedStaging": "sysx.memory.pinned",
    "register_host_memory": "sysx.memory.pinned",
}

__all__ = [
    "HostCapacity",
    "HostMemoryError",
    "HostMemoryPlan",
    "LiveViewsError",
    "drop_failure_views",
    "Segment",
    "SegmentError",
    "SegmentExistsError",
    "SegmentInfo",
    "SegmentName",
    "SegmentNotFoundError",
    "ShmBudgetError",
    "StaleSegmentError",
    "check_shm_request",
    "mpi_broadcast",
    "plan_host_memory",
    "probe_host",
    "release_all",
    "remove_ipc_warning",
    "resolve_job_id",
    "scan",
    "segment_name",
    "sweep_lock",
    "sweep_stale",
    "torch_broadcast",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sysx.memory' has no attribute {name!r}")
