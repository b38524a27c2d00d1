"""The search's view of ``optim.offload=nvme``: a candidate's fullest node with the tier (host
memory, state files) and the I/O its step cannot hide (:mod:`sysx.optim.nvme.cost`'s one-queue
model), charged to its predicted iteration so candidates are ranked with the disk's time in."""

from __future__ import annotations

from sysx.memory.node_plan import node_host_memory
from sysx.model import ModelConfig
from sysx.optim.nvme.cost import DiskRates, step_io
from sysx.replicas import ReplicaLayout
from sysx.schedule.costs import model_layer_params
from sysx.schedule.ops import Schedule
from sysx.schedule.replica_costs import schedule_units


def tier_memory(
    schedule: Schedule, model: ModelConfig, replicas: int, gpus_per_node: int, *, work_dtype: str, rollback: str
) -> tuple[float, float, float, float]:
    """``(host, shm, disk, step_io)`` bytes of the fullest node of ``replicas`` pipelines running
    ``schedule`` with the tier: host as :func:`~sysx.autotune.replicas.node_memory` counts it (the
    landing buffers left out) plus the staging pools, the state files, and one step's reads."""
    layout = ReplicaLayout(replicas, schedule.n_ranks, 0, local_world_size=gpus_per_node)
    units = schedule_units(schedule, model_layer_params(model))
    nodes = range(-(-layout.world_size // gpus_per_node))
    plain = [node_host_memory(units, layout, n, work_dtype, rollback=rollback) for n in nodes]
    tier = [node_host_memory(units, layout, n, work_dtype, rollback=rollback, offload="nvme") for n in nodes]
    host = max(t.total - p.pinned for p, t in zip(plain, tier, strict=True))  # staging stays in
    return host, max(t.shared for t in tier), max(t.disk for t in tier), max(t.step_io for t in tier)


def exposed_io(disk: DiskRates | None, nbytes: float, iteration: float) -> float:
    """Seconds one iteration of ``iteration`` seconds waits for ``nbytes`` read and again written
    through ``disk`` (0 without rates: nothing to charge)."""
    return 0.0 if disk is None else step_io(nbytes, nbytes, disk, iteration).exposed_s
