"""Resolve ``optim.rollback``: check the host-memory plan with the chosen rollback's buffers, and
turn ``auto`` into ``exact`` when that plan fits the host, else ``undo``.

``exact`` (bit-exact, the time of a plain step on the critical path plus a background copy)
costs 12 bytes per parameter (16 with an fp32 working copy); ``undo`` costs none and is within
about one ulp. The check is the cheap probe (``/proc/meminfo``, ``statvfs`` of ``/dev/shm``, the
cgroup limit) the job makes anyway before it allocates, so ``auto`` never picks buffers the node
cannot hold. ``undo`` stays the default for now: ``exact`` copies 12 bytes per parameter after
every step (off the critical path, but memory bandwidth the forward shares) and, with an fp32
working copy, steps a private master and copies it into the shared copy after every step.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from sysx.config.choices import ROLLBACKS
from sysx.memory.budget import HostCapacity, HostMemoryError, HostMemoryPlan, fmt_bytes, probe_host


def choose_rollback(
    requested: str,
    plan: Callable[[str], HostMemoryPlan],
    capacity: HostCapacity | None = None,
    *,
    disk_free: int | None = None,
) -> tuple[str, str]:
    """``(mode, why)``: ``requested`` after checking ``plan(mode)`` against the host (raising
    :class:`HostMemoryError` when it does not fit), or for ``auto`` the choice and a one-line reason.

    ``disk_free``: with the NVMe tier, the free bytes of ``optim.nvme_dir``; there ``exact`` costs no
    RAM but a second set of state files, so ``auto`` takes ``undo`` when that set does not fit."""
    if requested not in ROLLBACKS:
        raise ValueError(f"optim.rollback={requested!r} is not valid: allowed: {', '.join(ROLLBACKS)}")
    cap = probe_host() if capacity is None else capacity
    if requested != "auto":
        plan(requested).check(cap)
        return requested, ""
    exact = plan("exact")
    if disk_free is not None and exact.disk > disk_free:
        plan("undo").check(cap)
        return "undo", (
            f"optim.rollback=auto -> undo: the exact rollback's second set of state files does not fit "
            f"optim.nvme_dir (need {fmt_bytes(exact.disk)}, free {fmt_bytes(disk_free)}); undo keeps one set "
            "and is within ~1 ulp"
        )
    try:
        exact.check(cap)
    except HostMemoryError:
        plan("undo").check(cap)  # raises when even the plain plan does not fit
        return "undo", (
            f"optim.rollback=auto -> undo: the exact rollback's buffers ({fmt_bytes(exact.rollback)}) "
            f"do not fit this node's host memory (need {fmt_bytes(exact.total)}, available "
            f"{fmt_bytes(_available(cap))}); undo needs none and is within ~1 ulp"
        )
    return "exact", (
        f"optim.rollback=auto -> exact: its buffers ({fmt_bytes(exact.rollback)}) fit this node's host "
        f"memory (need {fmt_bytes(exact.total)}, available {fmt_bytes(_available(cap))}); rollbacks are "
        "bit-exact and a step costs a plain in-place one (a copy follows, off the critical path)"
    )


def _available(cap: HostCapacity) -> int:
    return min(cap.ram_available, cap.cgroup.available) if cap.cgroup is not None else cap.ram_available


def tier_disk_free(offload: str, nvme_dir: str | None) -> int | None:
    """The free bytes of ``optim.nvme_dir`` with the NVMe tier (None without it, or when the
    directory is missing: the pre-flight names that)."""
    if offload != "nvme" or nvme_dir is None or not os.path.isdir(nvme_dir):
        return None
    from sysx.optim.nvme.files import free_bytes

    return free_bytes(nvme_dir)
