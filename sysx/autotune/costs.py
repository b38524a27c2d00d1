"""A :class:`~sysx.autotune.profile.MachineProfile` turned into the simulator's
:class:`~sysx.schedule.costs.Costs`: the cost model is :func:`sysx.schedule.simulate.simulate` fed
with profiled numbers, the same path as ``sysx plan`` (one source of truth).

Sizes (parameters, activations, checkpoints, host bytes per parameter) come from the model shape
via :func:`~sysx.schedule.costs.costs_from_model`; the profile replaces its FLOP-based layer times
with the measured ones, its backward ratio with the measured one, and its bandwidths and CPU Adam
throughput with the machine's; p2p bandwidth and latency between ranks (in a node and between
nodes) are the profile's when it holds them (:mod:`sysx.autotune.p2p`, measured at tune time), else
:class:`Costs`' defaults. Sends are posted, as the runtime's isends are (the emulated device's
costs say the same: :mod:`sysx.emulate.costs`). On a CPU "device" with more ranks per node than
physical cores, the layer times grow by that ratio, or by the slowdown the job's ranks measured
together at tune time (:func:`cpu_share`), and so does the executor's
fixed host cost per instruction (``op_host``, :mod:`sysx.machine.host_cost`); every rank's host
memory holds the machine's fixed per-process bytes besides its state (``process_bytes``). On a
measured machine the node's cores are one host lane (:func:`host_lane`): the step is no shorter
than the CPU work of every rank of the node over its cores. On a CPU "device" a Block's
activations and a backward's own temporaries are the profile's measured bytes
(:meth:`~sysx.autotune.profile.MachineProfile.backward_work`), not the estimate from the shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sysx.autotune.profile import MachineProfile
from sysx.memory.budget import training_state_bytes
from sysx.model import ModelConfig
from sysx.schedule.costs import Costs, HostLane, costs_from_model


def layer_times(profile: MachineProfile, cfg: ModelConfig, tokens: float) -> tuple[list[float], list[float]]:
    """Forward and backward-with-recompute seconds of each flat layer ``[Embedding, Block x L, Head]``."""
    kinds = ["embedding"] + ["block"] * cfg.n_layers + ["head"]
    pairs = [profile.layer_time(k, tokens) for k in kinds]
    return [max(f, 1e-9) for f, _ in pairs], [max(b, 1e-9) for _, b in pairs]


def cpu_share(profile: MachineProfile, ranks_per_node: int | None) -> float:
    """How much slower a layer runs in the job than in the profile: the slowdown the job's ranks
    measured together at tune time when the profile holds one (:mod:`sysx.autotune.contention`);
    else, on a CPU "device", the ranks of a node over its physical cores (more ranks than cores
    time-slice them); 1.0 on a GPU."""
    if profile.hardware.kind != "cpu":
        return 1.0
    if profile.slowdown is not None:
        return profile.slowdown
    if not ranks_per_node:
        return 1.0
    return max(1.0, ranks_per_node / max(1, profile.cpu_threads))


def host_lane(profile: MachineProfile, share: float, threads_per_worker: int) -> HostLane | None:
    """The node's cores as the lane every rank's host work shares: on a CPU "device" a layer costs
    the node its profiled time times the CPU ratio its ranks measured together (1 when not
    measured), i.e. that over ``share`` per simulated second; on a GPU compute costs the host
    nothing. Every instruction costs its measured host time, an optimizer step its time on
    ``threads_per_worker`` threads. None for an assumed (emulated) machine: its plan is the model's."""
    hw = profile.hardware
    if not hw.measured or profile.cpu_threads < 1:
        return None
    compute = (profile.cpu_ratio or 1.0) / share if hw.kind == "cpu" else 0.0
    return HostLane(
        cores=float(profile.cpu_threads), compute_cpu=compute, op_cpu=hw.op_host_s, opt_threads=threads_per_worker
    )


ALLREDUCES_PER_STEP = 2  # VALIDATE's (gradient norm, overflow) and the step end's (losses, outcome)


def step_allreduces(world: int, latency: float) -> float:
    """Seconds of a step's small all-reduces over ``world`` processes: gloo's ring passes a message
    ``2 (world - 1)`` times one after another (reduce-scatter, then all-gather), each paying the
    per-message latency; :data:`ALLREDUCES_PER_STEP` of them, charged at the VALIDATE barrier."""
    return ALLREDUCES_PER_STEP * 2 * max(0, world - 1) * latency


def profiled_costs(
    profile: MachineProfile,
    cfg: ModelConfig,
    seq_len: int,
    micro_batch_size: int,
    *,
    work_dtype: str = "bfloat16",
    optim_workers: int | None = None,
    threads_per_worker: int = 1,
    gpus_per_node: int | None = None,
    rollback: str = "undo",
    world: int | None = None,
    **hardware: Any,
) -> Costs:
    """:class:`Costs` of ``cfg`` at ``seq_len`` x ``micro_batch_size`` on the profiled machine.

    ``work_dtype``: the working copy (``float32`` or ``bfloat16``): bytes per parameter on the GPU
    and in shared memory, and the host optimizer state. ``threads_per_worker``: CPU threads each
    optimizer worker steps with. ``gpus_per_node``: ranks per node (which messages cross nodes).
    ``rollback``: ``optim.rollback``, whose second (p, m, v) set (snapshot, exact) the host budget counts.
    ``world``: every process of the job (all replicas), whose step-end all-reduces cost
    :func:`step_allreduces` of the measured per-message latency (None: :class:`Costs`' default),
    unless the profile holds the meeting its ranks measured together (``meeting_s``,
    :mod:`sysx.autotune.contention`): a step's end with its collectives, charged instead.
    ``hardware`` overrides any :class:`Costs` field.
    """
    fwd, bwd = layer_times(profile, cfg, micro_batch_size * seq_len)
    share = cpu_share(profile, gpus_per_node)
    fwd, bwd = [t * share for t in fwd], [t * share for t in bwd]
    nbytes = 4 if work_dtype == "float32" else 2
    hw = profile.hardware
    base = costs_from_model(
        cfg,
        seq_len,
        micro_batch_size,
        dtype_bytes=nbytes,
        host_bytes_per_param=float(training_state_bytes(work_dtype, rollback=rollback).optimizer),
        h2d_bandwidth=hw.h2d_bytes_per_s,
        d2h_bandwidth=hw.d2h_bytes_per_s,
        optim_params_per_s=(profile.optim_job_params_per_s or profile.adam_params_per_s) * threads_per_worker,
        optim_workers=optim_workers,
    )
    # Costs charges a backward (1 + bwd_ratio) x forward with recompute: one ratio for the model,
    # the measured total backward over the measured total forward
    ratio = sum(bwd) / sum(fwd) - 1.0
    memory: dict[str, Any] = {}
    measured = profile.backward_work(micro_batch_size * seq_len)
    if measured is not None:  # a CPU "device": what the backward holds, measured, not the estimate
        per_block, once = measured
        acts = base.layer_act_bytes
        memory = {"layer_act_bytes": (acts[0], *(per_block,) * cfg.n_layers, acts[-1]), "bwd_once_bytes": once}
    links: dict[str, float] = profile.p2p.costs_fields() if profile.p2p is not None else {}
    if world is not None and profile.p2p is not None and profile.hardware.measured:  # the emulated plan keeps its own
        links["allreduce_latency"] = step_allreduces(world, profile.p2p.intra_latency)
    if profile.meeting_s:  # the step's end as the ranks measured it together, its collectives included (VALIDATE)
        links["allreduce_latency"] = profile.meeting_s
    return dataclasses.replace(
        base,
        layer_fwd_time=tuple(fwd),
        bwd_ratio=ratio,
        recompute=True,
        posted_sends=True,
        gpus_per_node=gpus_per_node,
        op_host=hw.op_host_s * share,
        process_bytes=float(hw.process_bytes),
        host_lane=host_lane(profile, share, threads_per_worker),
        **{**memory, **links, **hardware},
    )
