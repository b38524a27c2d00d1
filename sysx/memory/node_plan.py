"""The host memory of one node of a job of R replicas of a P-rank pipeline (pure data).

A node holds, once per unit (backward sub-stage) that one of its ranks owns or runs forward, the
unit's 16-bit working-copy segment: replicas on one node map the same segment. The fp32 master,
Adam m and v, the fp32 gradients and the rollback buffers exist only for the shards its ranks own
(:func:`sysx.replicas.shard_range`: 1/R of each owned unit per owning rank). The full-size host
gradient buffer the device-to-host copy lands in stays per owning rank: the 16-bit (pinned) buffer
of 16-bit runs, and with replicas one fp32 buffer of the whole unit in fp32 runs (at R=1 that
buffer is the optimizer's gradient buffer itself, with replicas each shard's fp32 gradients are its
slice of it, counted once). At R=1 the plan is
:func:`~sysx.memory.budget.plan_host_memory`'s, byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sysx.memory.budget import (
    HostMemoryPlan,
    grad_scratch_bytes,
    segment_bytes,
    stage_data_bytes,
    staging_bytes,
    training_state_bytes,
)
from sysx.memory.views import canonical_dtype, dtype_itemsize
from sysx.replicas import ReplicaLayout, shard_range


@dataclass(frozen=True)
class UnitPlace:
    """One backward sub-stage: its parameters and the pipeline ranks (0..P-1) that run it."""

    numel: int
    owner: int  # pipeline rank running its backward and optimizer
    fwd: int  # pipeline rank running its stage's forward


def node_host_memory(
    units: Sequence[UnitPlace],
    layout: ReplicaLayout,
    node: int,
    dtype: Any,
    *,
    rollback: str = "undo",
    offload: str = "host",
    workers: int = 1,
) -> HostMemoryPlan:
    """Host bytes node ``node`` needs for ``units`` run by every replica of ``layout`` in the working
    precision ``dtype`` (see the module doc); ``rollback``: ``optim.rollback``, resolved; ``offload``:
    ``optim.offload`` (``nvme``: the master, m, v and rollback set are in the state files, ``disk``,
    and each owning rank pins one staging pool of its largest shard; in 16-bit runs without
    replicas each owning rank converts its fp32 gradients per job into one scratch pool of its
    largest unit, :func:`~sysx.memory.budget.grad_scratch_bytes`, while replicas keep the fp32
    shard the reducer sums into); ``workers``: each
    rank's optimizer workers (the pools' size: :func:`~sysx.memory.budget.tier_staging_buffers`)."""
    r_count = layout.replicas
    state = training_state_bytes(dtype, rollback=rollback, offload=offload)
    grads_per = 4 if r_count > 1 else state.grads  # replicas: the reducer's fp32 shard, also with the tier
    landing = dtype_itemsize(dtype) if canonical_dtype(dtype) != "float32" or r_count > 1 else 0
    shared = shards = owners = segments = 0
    owned: dict[int, list[int]] = {}  # owning global rank on this node -> its optimizer shards' numels
    for unit in units:
        local = [r for r in range(r_count) if layout.node_of(layout.global_rank(unit.owner, r)) == node]
        forward_here = any(layout.node_of(layout.global_rank(unit.fwd, r)) == node for r in range(r_count))
        if local or forward_here:  # its segment (owned or a mirror), once per node
            shared += segment_bytes(stage_data_bytes([(dtype, unit.numel)]))
            segments += 1
        shards += sum(len(shard_range(unit.numel, r_count, r)) for r in local)
        owners += len(local) * unit.numel
        for r in local:
            rank = layout.global_rank(unit.owner, r)
            owned.setdefault(rank, []).append(len(shard_range(unit.numel, r_count, r)))
    staging = scratch = 0
    if offload == "nvme":
        staging = sum(staging_bytes(max(n), dtype, rollback=rollback, workers=workers) for n in owned.values())
        if r_count == 1:
            scratch = sum(grad_scratch_bytes(n, dtype, workers=workers) for n in owned.values())
    # fp32 runs with replicas: the optimizer's gradients are its shard's slice of the landing buffer
    landed = owners * landing - (shards * landing if canonical_dtype(dtype) == "float32" and r_count > 1 else 0)
    return HostMemoryPlan(
        shared,
        shards * state.master,
        shards * state.adam,
        shards * grads_per + scratch,
        landed + staging,
        segments,
        rollback=shards * state.snapshot,
        disk=shards * state.disk,
        step_io=shards * state.step_io,
    )


def optimizer_bytes(plan: HostMemoryPlan) -> int:
    """The optimizer part of a node's plan: fp32 masters, Adam m and v, fp32 gradients and rollback
    buffers (what replicas shard; the working copy and the landing buffers they do not)."""
    return plan.master + plan.optimizer + plan.grads + plan.rollback
