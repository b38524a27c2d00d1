"""Host memory budgets, checked before anything is allocated.

:func:`plan_host_memory` sizes what a node needs in shared memory (``/dev/shm``), in private RAM
(master weights, Adam states, gradients and ``optim.rollback``'s buffers: :func:`training_state_bytes`)
and in pinned staging; :meth:`HostMemoryPlan.check` compares it with the host (``/dev/shm``, RAM,
cgroup) and a shortage raises :class:`HostMemoryError` naming needed vs available and the fix.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sysx.memory.header import segment_bytes
from sysx.memory.names import SHM_DIR
from sysx.memory.views import canonical_dtype, dtype_itemsize

SECTION_ALIGN = 256  # bytes; each dtype section of a segment starts on this boundary
_UNLIMITED = 1 << 60


class HostMemoryError(MemoryError):
    """The node does not have the host memory (shared, RAM or cgroup) the job needs."""


class ShmBudgetError(HostMemoryError):
    """``/dev/shm`` is too small for the requested segment(s)."""


def fmt_bytes(n: float) -> str:
    """Human-readable bytes (binary units)."""
    if n is None or math.isinf(n):
        return "unlimited"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def shm_fix_hint(needed: int) -> str:
    """How to give a container or pod more ``/dev/shm`` for ``needed`` bytes (+10% headroom)."""
    gib = max(1, math.ceil(needed * 1.1 / 2**30))
    return (
        f"Fix: give {SHM_DIR} at least {gib} GiB: `docker run --shm-size={gib}g ...` (Docker's default is 64 MB); "
        f"Kubernetes: mount an `emptyDir: {{medium: Memory, sizeLimit: {gib}Gi}}` volume at {SHM_DIR}; "
        f"bare metal: `mount -o remount,size={gib}G {SHM_DIR}` (root). Or use more nodes so each holds fewer stages."
    )


# --- probes (tests patch these) ---------------------------------------------------------------
def shm_free_bytes(path: str = SHM_DIR) -> int:
    """Bytes an unprivileged process can still allocate in the tmpfs at ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def shm_total_bytes(path: str = SHM_DIR) -> int:
    """Size of the tmpfs at ``path``."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def ram_available_bytes() -> int:
    """RAM available for new allocations without swapping (``psutil.virtual_memory().available``)."""
    import psutil

    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory limit of this process's cgroup and its ancestors."""

    version: int
    path: str
    limit: int
    usage: int  # minus inactive file cache, which the kernel reclaims before failing

    @property
    def available(self) -> int:
        """Bytes left under the limit."""
        return max(0, self.limit - self.usage)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _inactive_file(stat_path: Path, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in stat_path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def cgroup_memory(proc_cgroup: str = "/proc/self/cgroup", fs_root: str = "/sys/fs/cgroup") -> CgroupMemory | None:
    """The binding cgroup memory limit (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``, the
    smallest headroom over the process's cgroup and its ancestors), or None when unlimited."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    v1 = [path for _, controllers, path in entries if "memory" in controllers.split(",")]
    v2 = [path for hierarchy, controllers, path in entries if hierarchy == "0" and controllers == ""]
    if v1:
        version, mount, rel = 1, Path(fs_root) / "memory", v1[0]
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    elif v2:
        version, mount, rel = 2, Path(fs_root), v2[0]
        files = ("memory.max", "memory.current", "inactive_file")
    else:
        return None
    leaf = mount / rel.strip("/")
    if not leaf.is_dir():
        leaf = mount  # a cgroup namespace: our cgroup is the mount's root
    best: CgroupMemory | None = None
    level = leaf
    while True:
        limit = _read_int(level / files[0])
        usage = _read_int(level / files[1])
        if limit is not None and limit < _UNLIMITED and usage is not None:
            usage = max(0, usage - _inactive_file(level / "memory.stat", files[2]))
            found = CgroupMemory(version, str(level), limit, usage)
            if best is None or found.available < best.available:
                best = found
        if level == mount or level.parent == level:
            break
        level = level.parent
    return best


@dataclass(frozen=True)
class HostCapacity:
    """What the node has free right now."""

    shm_free: int
    shm_total: int
    ram_available: int
    cgroup: CgroupMemory | None


def probe_host(shm_dir: str = SHM_DIR) -> HostCapacity:
    """Measure free ``/dev/shm``, available RAM and the cgroup limit."""
    return HostCapacity(shm_free_bytes(shm_dir), shm_total_bytes(shm_dir), ram_available_bytes(), cgroup_memory())


def check_shm_request(nbytes: int, *, what: str = "shared memory") -> None:
    """Raise :class:`ShmBudgetError` unless ``nbytes`` fit in free ``/dev/shm`` and under the cgroup
    limit (shared memory is charged to the cgroup of the process that allocates it)."""
    free = shm_free_bytes()
    if nbytes > free:
        raise ShmBudgetError(
            f"{what} needs {fmt_bytes(nbytes)} ({nbytes} bytes) of shared memory but {SHM_DIR} has only "
            f"{fmt_bytes(free)} ({free} bytes) free; nothing was allocated.\n" + shm_fix_hint(nbytes)
        )
    cgroup = cgroup_memory()
    if cgroup is not None and nbytes > cgroup.available:
        raise ShmBudgetError(
            f"{what} needs {fmt_bytes(nbytes)} of shared memory but the cgroup memory limit leaves only "
            f"{fmt_bytes(cgroup.available)} ({fmt_bytes(cgroup.limit)} limit at {cgroup.path}); nothing was allocated.\n"
            + _cgroup_fix_hint(nbytes + cgroup.usage)
        )


def _cgroup_fix_hint(needed_total: int) -> str:
    gib = max(1, math.ceil(needed_total * 1.1 / 2**30))
    return (
        f"Fix: raise the memory limit to at least {gib} GiB (`docker run --memory={gib}g`, Kubernetes "
        f"`resources.limits.memory: {gib}Gi`, Slurm `--mem={gib}G`), or use more nodes."
    )


# --- the training state, per parameter ---------------------------------------------------------
@dataclass(frozen=True)
class StateBytes:
    """Host bytes per parameter of the training state, by component."""

    master: int  # fp32 master weights (0 when the working copy is fp32: it is the master)
    adam: int  # Adam m and v, fp32
    grads: int  # gradients as the optimizer reads them
    working: int  # the working copy the device loads
    snapshot: int  # optim.rollback=snapshot / exact: the second p, m, v (exact + fp32: a private master too)
    disk: int = 0  # optim.offload=nvme: what moved from RAM to the state files (master, m, v, rollback set)
    step_io: int = 0  # optim.offload=nvme: bytes one step reads, and again writes (the master, m and v)

    @property
    def optimizer(self) -> int:
        """Everything but the working copy (which the pipeline keeps in shared memory)."""
        return self.master + self.adam + self.grads + self.snapshot

    @property
    def total(self) -> int:
        """All of it."""
        return self.optimizer + self.working

    def rows(self) -> dict[str, int]:
        """Non-zero components by name."""
        working = "working copy" if self.working < 4 else "fp32 masters (= working copy)"  # fp32: no other master
        names = {
            "fp32 masters": self.master,
            "Adam m+v": self.adam,
            "grads": self.grads,
            working: self.working,
            "rollback buffers": self.snapshot,
        }
        return {name: n for name, n in names.items() if n}


def training_state_bytes(
    work_dtype: Any, *, grad_dtype: Any = "float32", rollback: str = "undo", offload: str = "host"
) -> StateBytes:
    """Bytes per parameter of the host training state: the working copy in ``work_dtype``, the
    gradients in ``grad_dtype``, fp32 masters unless the working copy is fp32, Adam m and v, and
    the rollback buffers of ``rollback="snapshot"`` or ``"exact"`` (``auto`` counts as ``undo``: it
    picks ``exact`` only where that fits, :mod:`sysx.optim.rollback_choice`). ``offload="nvme"``
    (``optim.offload``) keeps the fp32 state in files (``disk``): one slot of (p, m, v) per parameter
    (m and v only in fp32 runs, whose master is the working copy in RAM), two slots with ``snapshot``
    or ``exact`` (a step reads one and writes the other; p is in both so a rollback restores it);
    RAM keeps the working copy and the gradients, except fp32 gradients of a 16-bit working copy: the
    tier's optimizer converts them per job into a per-rank scratch pool (:func:`grad_scratch_bytes`),
    so they cost 0 per parameter here, like the staging buffers (per rank, not per parameter)."""
    work = dtype_itemsize(work_dtype)
    master = 0 if canonical_dtype(work_dtype) == "float32" else 4
    if offload == "nvme":
        slots = 2 if rollback in ("snapshot", "exact") else 1
        one = 12 if master or slots == 2 else 8  # bytes of one slot per parameter
        pooled = master and canonical_dtype(grad_dtype) == "float32"
        grads = 0 if pooled else dtype_itemsize(grad_dtype)
        return StateBytes(0, 0, grads, work, 0, disk=slots * one, step_io=one)
    extra = {"snapshot": 12, "exact": 12 if master else 16}.get(rollback, 0)
    return StateBytes(master, 8, dtype_itemsize(grad_dtype), work, extra)


# optim.offload=nvme: a rank's tier pool holds one staging buffer (one slot of its largest stage) per
# optimizer worker and these more: one read ahead, one written back behind (sysx.optim.nvme.open_tier)
TIER_EXTRA_BUFFERS = 2
# 16-bit runs with the tier convert each job's gradients to fp32 in a per-rank scratch pool: one buffer
# per optimizer worker and this many more: the device lane's steps on the trainer's own thread
GRAD_SCRATCH_EXTRA = 1
PAGE_BYTES = 4096  # O_DIRECT buffers and file regions are whole pages (sysx.optim.nvme's ALIGN)


def tier_staging_buffers(workers: int) -> int:
    """Staging buffers of one rank's tier pool with ``workers`` optimizer workers."""
    return max(1, workers) + TIER_EXTRA_BUFFERS


def grad_scratch_buffers(workers: int) -> int:
    """fp32 gradient buffers of one rank's scratch pool with ``workers`` optimizer workers: a job
    holds one while it converts and steps (undo and re-step convert again from the 16-bit gradients,
    bit for bit), so the jobs that can run at once bound it."""
    return max(1, workers) + GRAD_SCRATCH_EXTRA


def staging_bytes(largest_numel: int, work_dtype: Any, *, rollback: str = "undo", workers: int = 1) -> int:
    """Pinned bytes of one rank's tier staging pool when its largest stage (or shard) has ``largest_numel``
    parameters in ``work_dtype`` and it runs ``workers`` optimizer workers: :func:`tier_staging_buffers`
    buffers of one slot, each fp32 tensor page-rounded."""
    tensors = training_state_bytes(work_dtype, rollback=rollback, offload="nvme").step_io // 4
    return tier_staging_buffers(workers) * tensors * (-(-4 * largest_numel // PAGE_BYTES) * PAGE_BYTES)


def uses_grad_scratch(owned_numels: Sequence[int], *, workers: int = 1) -> bool:
    """Whether a rank owning stages of ``owned_numels`` parameters converts its fp32 gradients into a
    scratch pool with the NVMe tier: only where the pool is smaller than a buffer per stage (a rank
    owning as few stages as the pool has buffers keeps its buffers and never converts twice)."""
    return bool(owned_numels) and grad_scratch_buffers(workers) * max(owned_numels) < sum(owned_numels)


def grad_scratch_bytes(owned_numels: Sequence[int], work_dtype: Any, *, workers: int = 1) -> int:
    """Host bytes of one rank's fp32 gradients with the NVMe tier when it owns stages of ``owned_numels``
    parameters: the scratch pool (:func:`grad_scratch_buffers` buffers of its largest stage), or
    its stages' own buffers where those are smaller (:func:`uses_grad_scratch`); 0 in fp32 runs,
    whose gradients land in their own fp32 buffer, counted per parameter."""
    if canonical_dtype(work_dtype) == "float32" or not owned_numels:
        return 0
    if uses_grad_scratch(owned_numels, workers=workers):
        return grad_scratch_buffers(workers) * 4 * max(owned_numels)
    return 4 * sum(owned_numels)


# --- the per-node plan ------------------------------------------------------------------------
StageSizes = Mapping[Any, int] | tuple[int, Any]


def _sections(stage: StageSizes) -> list[tuple[Any, int]]:
    if isinstance(stage, Mapping):
        return list(stage.items())
    numel, dtype = stage
    return [(dtype, numel)]


def stage_data_bytes(sections: Iterable[tuple[Any, int]]) -> int:
    """Payload bytes of a segment holding ``(dtype, numel)`` sections, each aligned to 256 bytes."""
    offset = 0
    for dtype, numel in sections:
        offset = -(-offset // SECTION_ALIGN) * SECTION_ALIGN
        offset += numel * dtype_itemsize(dtype)
    return offset


@dataclass(frozen=True)
class HostMemoryPlan:
    """Bytes one node needs in host memory, by component. ``check()`` compares with the host."""

    shared: int
    master: int
    optimizer: int
    grads: int
    pinned: int
    segments: int
    notes: tuple[str, ...] = field(default=())
    rollback: int = 0  # optim.rollback=snapshot / exact buffers
    disk: int = 0  # optim.offload=nvme: the state files under optim.nvme_dir (not host memory)
    step_io: int = 0  # optim.offload=nvme: bytes read, and again written, per step

    @property
    def private(self) -> int:
        """RAM outside shared memory (master weights, Adam states, gradients, rollback buffers, pinned staging)."""
        return self.master + self.optimizer + self.grads + self.rollback + self.pinned

    @property
    def total(self) -> int:
        """All host memory the node needs (shared memory lives in RAM too)."""
        return self.shared + self.private

    def rows(self) -> list[tuple[str, int]]:
        """(component, bytes) rows."""
        return [
            (f"shared memory: 16-bit working params ({self.segments} segments)", self.shared),
            ("fp32 master weights", self.master),
            ("Adam m and v (fp32)", self.optimizer),
            ("fp32 gradients", self.grads),
            *([("rollback buffers (optim.rollback)", self.rollback)] if self.rollback else []),
            ("pinned staging buffers", self.pinned),
            ("total host memory", self.total),
            *([("state files on disk (optim.offload=nvme)", self.disk)] if self.disk else []),
        ]

    def __str__(self) -> str:
        width = max(len(name) for name, _ in self.rows())
        return "\n".join(f"{name:<{width}}  {fmt_bytes(n):>11}" for name, n in self.rows())

    def check(self, capacity: HostCapacity | None = None) -> HostCapacity:
        """Raise :class:`HostMemoryError` (or :class:`ShmBudgetError` when only ``/dev/shm`` is short)
        listing every shortage with needed vs available and the fix; return the capacity used."""
        cap = probe_host() if capacity is None else capacity
        problems: list[str] = []
        only_shm = True
        if self.shared > cap.shm_free:
            problems.append(
                f"shared memory ({SHM_DIR}): need {fmt_bytes(self.shared)}, free {fmt_bytes(cap.shm_free)} "
                f"(of {fmt_bytes(cap.shm_total)}).\n  " + shm_fix_hint(self.shared)
            )
        if self.total > cap.ram_available:
            only_shm = False
            problems.append(
                f"host RAM: need {fmt_bytes(self.total)} (shared {fmt_bytes(self.shared)} + private "
                f"{fmt_bytes(self.private)}), available {fmt_bytes(cap.ram_available)}.\n  Fix: use more nodes "
                "(each owns fewer stages), free memory held by other processes, or a machine with more RAM."
            )
        if cap.cgroup is not None and self.total > cap.cgroup.available:
            only_shm = False
            problems.append(
                f"cgroup memory limit: need {fmt_bytes(self.total)}, available {fmt_bytes(cap.cgroup.available)} "
                f"under the {fmt_bytes(cap.cgroup.limit)} limit of {cap.cgroup.path} (cgroup v{cap.cgroup.version}).\n  "
                + _cgroup_fix_hint(self.total + cap.cgroup.usage)
            )
        if problems:
            error = ShmBudgetError if only_shm else HostMemoryError
            raise error(
                "this node does not have the host memory the job needs (nothing was allocated):\n- "
                + "\n- ".join(problems)
                + "\n\nPlan:\n"
                + str(self)
            )
        return cap


def plan_host_memory(
    owned: Sequence[StageSizes],
    *,
    mirrors: Sequence[StageSizes] = (),
    pinned_bytes: int = 0,
    rollback: str = "undo",
    offload: str = "host",
    workers: int = 1,
) -> HostMemoryPlan:
    """Host bytes one node needs.

    ``owned``: the sub-stages whose optimizer runs on this node, each ``(numel, dtype)`` of its
    shared working copy or a ``{dtype: numel}`` mapping; ``mirrors``: remote-owned stages mirrored
    here (shared memory only). Per parameter, :func:`training_state_bytes` with fp32 gradients
    (master weights are skipped for fp32 sections: the shared copy is the master) and the
    buffers of ``rollback`` (``optim.rollback``, resolved: ``auto`` counts as ``undo``); with
    ``offload="nvme"`` the master, m, v and rollback set are on disk, one staging pool of the
    largest stage is pinned (:func:`staging_bytes`) and 16-bit gradients are converted into one
    scratch pool (:func:`grad_scratch_bytes`), both of ``workers`` optimizer workers.
    """
    shared = master = optimizer = grads = extra = disk = step_io = staging = 0
    pooled: dict[Any, list[int]] = {}  # working dtype -> its stages' numels (the gradients' scratch)
    for stage in owned:
        sections = _sections(stage)
        shared += segment_bytes(stage_data_bytes(sections))
        for dtype, numel in sections:
            per_param = training_state_bytes(dtype, rollback=rollback, offload=offload)
            master += numel * per_param.master
            extra += numel * per_param.snapshot
            optimizer += numel * per_param.adam
            grads += numel * per_param.grads
            disk += numel * per_param.disk
            step_io += numel * per_param.step_io
            if offload == "nvme":
                staging = max(staging, staging_bytes(numel, dtype, rollback=rollback, workers=workers))
                pooled.setdefault(dtype, []).append(numel)
    for stage in mirrors:
        shared += segment_bytes(stage_data_bytes(_sections(stage)))
    if pinned_bytes < 0:
        raise ValueError(f"pinned_bytes must be >= 0, got {pinned_bytes}")
    count = len(owned) + len(mirrors)
    pinned = pinned_bytes + staging
    grads += sum(grad_scratch_bytes(numels, dtype, workers=workers) for dtype, numels in pooled.items())
    return HostMemoryPlan(shared, master, optimizer, grads, pinned, count, rollback=extra, disk=disk, step_io=step_io)


# --- systemd RemoveIPC ------------------------------------------------------------------------
LOGIND_CONF = "/etc/systemd/logind.conf"
LOGIND_DROPIN_DIRS = (
    "/usr/lib/systemd/logind.conf.d",
    "/usr/local/lib/systemd/logind.conf.d",
    "/run/systemd/logind.conf.d",
    "/etc/systemd/logind.conf.d",
)


def remove_ipc_setting(conf: str = LOGIND_CONF, dropin_dirs: Sequence[str] = LOGIND_DROPIN_DIRS) -> bool | None:
    """The effective ``RemoveIPC`` of systemd-logind (True = yes, the default when unset), or None
    when no logind configuration exists (no systemd)."""
    files = [Path(conf)] if Path(conf).is_file() else []
    dropins: dict[str, Path] = {}
    for directory in dropin_dirs:  # later directories override same-named files
        if Path(directory).is_dir():
            for path in Path(directory).glob("*.conf"):
                dropins[path.name] = path
    files += [dropins[name] for name in sorted(dropins)]
    if not files:
        return None
    value = True
    for path in files:
        section = ""
        try:
            text = path.read_text()
        except OSError:
            continue
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line.strip("[]").strip()
                continue
            key, sep, val = line.partition("=")
            if sep and section == "Login" and key.strip() == "RemoveIPC":
                value = val.strip().lower() in ("yes", "true", "1", "on")
    return value


def remove_ipc_warning(uid: int | None = None, **paths: Any) -> str | None:
    """A warning text when systemd-logind may delete this user's segments under a running job.

    logind's RemoveIPC spares root and system users (uid < 1000), so only regular users are at risk.
    """
    uid = os.getuid() if uid is None else uid
    if uid < 1000 or not remove_ipc_setting(**paths):
        return None
    return (
        f"systemd-logind has RemoveIPC=yes (the default when unset): when the last login session of uid {uid} "
        "ends (e.g. ssh logout), logind deletes all of that user's shared memory, and a running sysx job loses "
        "its parameter segments (SIGBUS / FileNotFoundError). Fix: `loginctl enable-linger $USER`, run under a "
        "batch scheduler, or set RemoveIPC=no in /etc/systemd/logind.conf and `systemctl restart systemd-logind`."
    )


_warned_remove_ipc = False


def warn_remove_ipc_once() -> None:
    """Emit the RemoveIPC warning at most once per process."""
    global _warned_remove_ipc
    if _warned_remove_ipc:
        return
    _warned_remove_ipc = True
    text = remove_ipc_warning()
    if text:
        warnings.warn("sysx: " + text, RuntimeWarning, stacklevel=2)
