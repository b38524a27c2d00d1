"""Replicas in the configuration search: which replica counts a job may take, what their reductions
and shard exchange cost on the profiled machine, and the host memory of their nodes.

A job of ``n`` processes may run as R replicas of an ``n / R``-rank pipeline for every R that
divides both ``n`` and the global batch (each replica takes ``1/R`` of the batch). Replicas on one
node share its working copy and each rank keeps only its optimizer shard, so a node's host memory
is :func:`sysx.memory.node_plan.node_host_memory` of the node, the fullest node's being what the
budget must hold.
"""

from __future__ import annotations

from collections.abc import Sequence

from sysx.autotune.profile import MachineProfile
from sysx.memory.node_plan import node_host_memory
from sysx.model import ModelConfig
from sysx.replicas import ReplicaLayout
from sysx.schedule.costs import model_layer_params
from sysx.schedule.ops import Schedule
from sysx.schedule.replica_costs import ADAM_BYTES_PER_PARAM, ReplicaCosts, schedule_units


def replica_counts(n_ranks: int, global_batch: int, replicas: int | None) -> list[int]:
    """The replica counts searched: ``replicas`` when given, else every divisor of ``n_ranks`` that
    also divides ``global_batch``, fewest first."""
    if replicas is not None:
        return [replicas]
    return [r for r in range(1, n_ranks + 1) if n_ranks % r == 0 and global_batch % r == 0]


def replica_costs(
    replicas: int, pipeline: int, gpus_per_node: int, profile: MachineProfile, *, work_dtype: str
) -> ReplicaCosts | None:
    """The replicas' reduction and exchange on the profiled links (between nodes: the profile's
    inter-node p2p figures, else its in-node ones; in a node's memory: one reducer thread at one
    Adam thread's bandwidth). None for one replica."""
    if replicas == 1:
        return None
    layout = ReplicaLayout(replicas, pipeline, 0, local_world_size=gpus_per_node)
    p2p = profile.p2p
    bandwidth, latency = 10e9, 20e-6  # Costs' defaults when nothing was measured
    if p2p is not None:
        bandwidth, latency = p2p.intra_bandwidth, p2p.intra_latency
        if p2p.inter_bandwidth is not None and p2p.inter_latency is not None:
            bandwidth, latency = p2p.inter_bandwidth, p2p.inter_latency
    return ReplicaCosts(
        replicas,
        layout.peers_share_node(),
        link_bandwidth=bandwidth,
        link_latency=latency,
        memory_bandwidth=profile.adam_params_per_s * ADAM_BYTES_PER_PARAM,
        param_bytes=4.0 if work_dtype == "float32" else 2.0,
    )


def node_memory(
    schedule: Schedule, model: ModelConfig, replicas: int, gpus_per_node: int, *, work_dtype: str, rollback: str
) -> tuple[float, float]:
    """``(host, shm)`` bytes of the fullest node of ``replicas`` pipelines running ``schedule``: its
    optimizer shards and working copy (what the search's host budget counts at one replica: the
    landing buffers are left out there too), and its shared working copy."""
    layout = ReplicaLayout(replicas, schedule.n_ranks, 0, local_world_size=gpus_per_node)
    units = schedule_units(schedule, model_layer_params(model))
    nodes = -(-layout.world_size // gpus_per_node)
    plans = [node_host_memory(units, layout, n, work_dtype, rollback=rollback) for n in range(nodes)]
    return max(p.total - p.pinned for p in plans), max(p.shared for p in plans)


def landing_bytes(
    schedule: Schedule, layer_params: Sequence[float], replicas: int, gpus_per_node: int, *, work_dtype: str
) -> float:
    """Bytes of the landing buffers of all nodes of ``replicas`` pipelines running ``schedule`` (the
    pinned part of :func:`~sysx.memory.node_plan.node_host_memory`, which the search's host budget
    leaves out and the prediction check, comparing with the processes' memory, counts)."""
    layout = ReplicaLayout(replicas, schedule.n_ranks, 0, local_world_size=gpus_per_node)
    units = schedule_units(schedule, [int(x) for x in layer_params])
    nodes = -(-layout.world_size // gpus_per_node)
    return float(sum(node_host_memory(units, layout, n, work_dtype).pinned for n in range(nodes)))
