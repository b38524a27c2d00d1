"""How many CPU threads the optimizer of each local rank may use, so ranks do not fight.

:func:`plan_cores` splits the physical cores available to the job on this node evenly between its
ranks and, within a rank, into workers and intra-op threads by the backend's thread layout
(:func:`thread_layout`). :func:`apply_plan` sets the main thread's torch/OpenMP threads and
``OMP_NUM_THREADS``, pins the process to its slice of the affinity mask where :func:`bind_choice`
says so, and logs the plan.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil
import torch

from sysx.config.choices import EMULATED_DEVICE, bind_setting

log = logging.getLogger("sysx.optim")

TORCH_THREADS_PER_WORKER = 4


@dataclass(frozen=True)
class CorePlan:
    """The thread plan of one local rank."""

    local_rank: int
    local_world_size: int
    node_physical_cores: int  # physical cores usable by the job on this node
    cores_per_rank: int
    cpus: tuple[int, ...]  # this rank's slice of the affinity mask (logical CPU ids)
    optimizer_workers: int
    threads_per_worker: int
    oversubscribed: bool  # fewer physical cores than local ranks

    def describe(self) -> str:
        """One log line."""
        note = " (OVERSUBSCRIBED: fewer cores than local ranks)" if self.oversubscribed else ""
        return (
            f"local rank {self.local_rank}/{self.local_world_size}: {self.cores_per_rank} of "
            f"{self.node_physical_cores} physical cores, CPUs {_ranges(self.cpus)}; optimizer "
            f"{self.optimizer_workers} worker(s) x {self.threads_per_worker} thread(s){note}"
        )


def _ranges(cpus: tuple[int, ...]) -> str:
    out: list[str] = []
    for c in cpus:
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out) or "-"


def _env_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return default


def cgroup_cpu_limit() -> float | None:
    """CPUs allowed by the cgroup v2 (``cpu.max``) or v1 (``cfs_quota_us``) quota; None if unlimited."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    try:
        q = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        p = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if q <= 0 else q / p
    except (OSError, ValueError):
        return None


# The job's mask before ``bind_to`` narrowed this rank's (inherited by the tune's child processes):
# the node's cores stay the job's, not the one slice a pinned rank now sees.
NODE_CPUS_ENV = "SYSX_NODE_CPUS"


def usable_physical_cores() -> tuple[int, list[int]]:
    """``(physical cores usable by the job on this node, its affinity mask)``: this process's mask,
    or the job's as it was before the rank was pinned (``parallel.bind_cores``)."""
    logical = psutil.cpu_count(logical=True) or 1
    physical = psutil.cpu_count(logical=False) or logical
    if os.environ.get(NODE_CPUS_ENV):
        affinity = sorted(int(c) for c in os.environ[NODE_CPUS_ENV].split(","))
    else:
        try:
            affinity = sorted(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            affinity = list(range(logical))
    smt = max(1, logical // physical)
    cores = max(1, len(affinity) // smt)
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = max(1, min(cores, math.floor(limit)))
    return cores, affinity


def thread_layout(backend: str) -> Literal["torch", "deepspeed"]:
    """Whose thread layout a plan assumes for ``optim.backend``: torch's only when asked for
    (``auto`` and ``deepspeed`` run DeepSpeed's op when it is there)."""
    return "torch" if backend == "torch" else "deepspeed"


def split_workers(cores: int, *, n_stages: int, backend: str, workers: int | None = None) -> tuple[int, int]:
    """``(optimizer workers, threads per worker)`` for a rank with ``cores`` cores (docs/architecture.md's rule;
    ``backend``: ``optim.backend`` as given; ``workers`` pins the count)."""
    torch_layout = thread_layout(backend) == "torch"
    if workers is None:
        workers = min(n_stages, max(1, cores // TORCH_THREADS_PER_WORKER)) if torch_layout else 1
    if workers < 1:
        raise ValueError(f"plan_cores: workers={workers} must be >= 1")
    return workers, max(1, cores // workers) if torch_layout else cores


def rank_cores(local_world_size: int) -> int:
    """The physical cores each of ``local_world_size`` ranks on this node computes with (at least 1):
    its intra-op threads (:func:`apply_plan`)."""
    return max(1, usable_physical_cores()[0] // max(1, local_world_size))


# An idle libgomp thread spins 300k rounds for the next parallel region while the process's OpenMP
# threads (every team's) number at most its CPUs, and 100 past that (GOMP_SPINCOUNT): each of a
# small model's short regions then wakes it from sleep. A CPU job's compute team is as wide as the
# cores, so an optimizer worker's own team put it past the count: the default tiny job ran 1.4-1.8x
# its plan, its second core adding nothing (profiling/RESULTS.md, "Twentieth session"). One thread
# a worker starts no team.
HOST_COMPUTE_WORKER_THREADS = 1


def worker_threads_beside(device: torch.device) -> int | None:
    """Intra-op threads for each optimizer worker of a job computing on ``device``:
    :data:`HOST_COMPUTE_WORKER_THREADS` where the host computes (``device`` is the CPU), so the
    compute's OpenMP team stays the process's only one; None (the worker takes torch's count) beside
    a GPU, where the main thread runs no parallel regions to slow."""
    return None if device.type == "cuda" else HOST_COMPUTE_WORKER_THREADS


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads on this thread, then restore the previous count:
    what is timed for a rank (a profile, a probe) is timed with the threads the rank will compute with."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def plan_cores(
    *,
    n_stages: int,
    backend: str = "deepspeed",
    local_rank: int | None = None,
    local_world_size: int | None = None,
    workers: int | None = None,
) -> CorePlan:
    """The thread plan for this rank (local rank/size default to the launcher's environment)."""
    if n_stages < 1:
        raise ValueError(f"plan_cores: n_stages={n_stages} must be >= 1")
    lws = (
        local_world_size
        if local_world_size is not None
        else _env_int(("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"), 1)
    )
    lr = (
        local_rank
        if local_rank is not None
        else _env_int(("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"), 0)
    )
    if lws < 1 or not 0 <= lr < lws:
        raise ValueError(f"plan_cores: local_rank={lr} must be in [0, local_world_size={lws})")
    cores, affinity = usable_physical_cores()
    per_rank = rank_cores(lws)
    if lws <= len(affinity):
        per_cpus = len(affinity) // lws
        cpus = tuple(affinity[lr * per_cpus : (lr + 1) * per_cpus])
    else:  # more ranks than CPUs: neighbouring ranks share one, every CPU gets its share of ranks
        cpus = (affinity[lr * len(affinity) // lws],)
    workers, threads = split_workers(per_rank, n_stages=n_stages, backend=backend, workers=workers)
    return CorePlan(
        local_rank=lr,
        local_world_size=lws,
        node_physical_cores=cores,
        cores_per_rank=per_rank,
        cpus=cpus,
        optimizer_workers=workers,
        threads_per_worker=threads,
        oversubscribed=cores < lws,
    )


def apply_plan(plan: CorePlan, *, bind: bool = False, why: str = "") -> None:
    """Set this process's torch/OpenMP threads to the rank's cores, log the plan and, with ``bind``
    (``parallel.bind_cores``; ``why``: :func:`bind_choice`'s reason), pin the process and every thread
    it starts later to ``plan.cpus``."""
    torch.set_num_threads(plan.cores_per_rank)
    os.environ["OMP_NUM_THREADS"] = str(plan.cores_per_rank)  # for child processes and late OpenMP users
    if bind:
        bind_to(plan)
    level = logging.WARNING if plan.oversubscribed else logging.INFO
    log.log(level, "core plan: %s, %s", plan.describe(), pinning(bind, why))


def pinning(bind: bool, why: str = "") -> str:
    """``pinned (why)`` or ``not pinned (why)``: the words a plan's log line and the job's header give."""
    return ("pinned" if bind else "not pinned") + (f" ({why})" if why else "")


def bind_choice(value: object, *, local_world_size: int, device: str) -> tuple[bool, str]:
    """Whether a rank pins itself (``parallel.bind_cores=value``) and why, for the core plan's log line.

    ``auto`` pins when the job's ranks have their CPUs to themselves as far as a process can tell:
    the mask it inherited is narrower than the node (a scheduler's cpuset or ``taskset`` gave the job
    those CPUs), or its ranks fill the node, one per GPU with none hidden by ``CUDA_VISIBLE_DEVICES``,
    or on the CPU at least one per physical core, where a second job contends with it whether pinned
    or not. Otherwise the plan cannot see who else runs here, and two jobs' rank 0 would pin to the
    same CPUs. The emulated device (``device="emulated"``) stays unpinned: its ranks stand for GPUs this
    machine lacks, and its measured figures were taken so."""
    setting = bind_setting(value)
    if setting != "auto":
        return setting, f"parallel.bind_cores={str(setting).lower()}"
    if not hasattr(os, "sched_setaffinity"):
        return False, "auto: this platform cannot pin a process"
    if device == EMULATED_DEVICE:
        return False, "auto: the emulated device's ranks stand for GPUs, not this node's CPUs"
    online = os.cpu_count() or 1
    cores, affinity = usable_physical_cores()
    mask = len(affinity)
    if mask < online:
        return True, f"auto: the job's CPU mask holds {mask} of the node's {online} CPUs"
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        gpus = torch.cuda.device_count()
        if os.environ.get("CUDA_VISIBLE_DEVICES") is None and local_world_size >= gpus:
            return True, f"auto: {local_world_size} ranks use all {gpus} GPUs of the node"
        return False, f"auto: {local_world_size} ranks beside GPUs other jobs may use"
    if local_world_size >= cores:
        return True, f"auto: {local_world_size} ranks fill the node's {cores} physical cores"
    return False, f"auto: {local_world_size} ranks leave {cores - local_world_size} of {cores} physical cores free"


def bind_to(plan: CorePlan) -> None:
    """Pin this process to ``plan.cpus``: the threads it starts afterwards (optimizer workers,
    gloo's, OpenMP's) inherit the mask, so a rank's host work stays on its own cores. Raises
    ``OSError`` naming the CPUs where the platform cannot pin."""
    if not hasattr(os, "sched_setaffinity"):
        raise OSError(
            f"parallel.bind_cores: this platform cannot pin a process (CPUs {_ranges(plan.cpus)}); set it false"
        )
    if not os.environ.get(NODE_CPUS_ENV):
        os.environ[NODE_CPUS_ENV] = ",".join(map(str, usable_physical_cores()[1]))
    os.sched_setaffinity(0, set(plan.cpus))
