"""The costs an emulated run paces itself by: :func:`sysx.schedule.costs.costs_from_model` of the
emulated preset on the emulated cluster, resolved for the schedule the run executes, and the plan
``simulate`` makes of them. The same function and table ``sysx plan`` uses, so every modelled
duration of the run is a number of that table, and measured and planned compare line by line.

Two choices follow the runtime rather than ``sysx plan``'s defaults: sends are posted (the
executor's sends are isends; the transfer runs once the receive is posted), and the CPU optimizer
has a finite number of workers that share the rank's threads (``optim.workers``, else the rule of
:func:`sysx.optim.cores.split_workers` for the emulated threads): a synchronous optimizer steps with
all of the rank's threads, each of ``W`` asynchronous workers with ``1/W`` of them. The real host
work of every executor instruction (:func:`op_host_seconds`) is planned too, in modelled seconds,
and the pacer charges it on the rank's cursor as the simulator does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sysx.config import ConfigError, SysxConfig
from sysx.emulate.profiles import GIB, EmulatedCluster, cluster
from sysx.machine.hardware_cache import cached_op_host_s
from sysx.memory.budget import grad_scratch_bytes, staging_bytes, tier_staging_buffers, training_state_bytes
from sysx.model import ModelConfig, get_preset
from sysx.optim.cores import split_workers
from sysx.optim.placement import device_flow
from sysx.replicas import ReplicaLayout
from sysx.schedule import Schedule
from sysx.schedule.costs import Costs, CostTable, costs_from_model
from sysx.schedule.disk import DiskCosts, DiskTimeline, disk_costs, with_disk
from sysx.schedule.replica_costs import ADAM_BYTES_PER_PARAM, ReplicaCosts
from sysx.schedule.simulate import Timeline, simulate

# An undo's time in steps of the same stage, by optim.rollback (profiling/RESULTS.md "Rollback
# cost", DeepSpeed at 50M elements: undo 215.8 ms vs a step 26.7 ms; snapshot restores p, m, v
# by a copy like the one its step adds, +38.0 ms; exact rolls back by not switching its sets, and
# refreshes its spare set in the background, which is not modelled)
UNDO_STEPS = {"undo": 8.1, "snapshot": 1.4, "exact": 0.0}


@dataclass(frozen=True)
class EmulatedModel:
    """The model the costs describe: ``emulate.model`` at the emulated micro-batch shape."""

    name: str
    config: ModelConfig
    seq_len: int
    micro_batch_size: int


@dataclass
class EmulatedPlan:
    """Cluster, model, costs, their table for the schedule and the simulated plan."""

    cluster: EmulatedCluster
    model: EmulatedModel
    costs: Costs
    table: CostTable
    timeline: Timeline
    optimizer_workers: int  # concurrent CPU optimizer steps per rank (1 for a synchronous optimizer)
    disk: DiskCosts | None = None  # optim.offload=nvme: the tier's reads and writes per sub-stage
    disk_timeline: DiskTimeline | None = None  # and the steady-state iteration with them

    def describe(self) -> str:
        """The cluster and the model whose costs the plan has."""
        m = self.model
        return (
            f"{self.cluster.describe()}; costs of {m.name} at {m.micro_batch_size}x{m.seq_len} tokens per micro-batch"
            + ("; optimizer states on NVMe" if self.disk else "")
        )

    @property
    def iteration(self) -> float:
        """The planned iteration (seconds): with the NVMe tier's exposed I/O when it is on."""
        return self.disk_timeline.iteration if self.disk_timeline else self.timeline.iteration

    @property
    def bubble_ratio(self) -> float:
        """The planned bubble ratio at :attr:`iteration`."""
        it, busy = self.iteration, self.timeline.busy
        return (it * len(busy) - sum(busy)) / (it * len(busy)) if it > 0 and busy else 0.0


def emulated_model(cfg: SysxConfig) -> EmulatedModel:
    """``emulate.model`` at ``emulate.seq_len`` x ``emulate.micro_batch_size`` (null: ``train.*``)."""
    e, t = cfg.emulate, cfg.train
    return EmulatedModel(e.model, get_preset(e.model), e.seq_len or t.seq_len, e.micro_batch_size or t.micro_batch_size)


def optimizer_workers(hw: EmulatedCluster, schedule: Schedule, *, backend: str, workers: int | None) -> int:
    """Concurrent optimizer steps of a rank: ``workers`` if given, else the core plan's rule for the
    emulated threads (1 for a synchronous optimizer, which steps on the main thread)."""
    if not schedule.options.async_optimizer:
        return 1
    owned = max(len(schedule.assignment.bwd_substages(r)) for r in range(schedule.n_ranks))
    return split_workers(hw.threads_per_rank, n_stages=owned, backend=backend, workers=workers)[0]


def replica_costs(hw: EmulatedCluster, replicas: int, pipeline: int, *, precision: str) -> ReplicaCosts | None:
    """The replicas of a ``pipeline``-rank pipeline on ``hw`` (None for one): peers on one node
    (:meth:`ReplicaLayout.peers_share_node` with the emulated nodes) reduce through its memory at one
    reducer thread's bandwidth, others over the inter-node link (:mod:`sysx.schedule.replica_costs`)."""
    if replicas == 1:
        return None
    layout = ReplicaLayout(replicas, pipeline, 0, local_world_size=hw.gpus_per_node)
    return ReplicaCosts(
        replicas,
        layout.peers_share_node(),
        link_bandwidth=hw.inter_bandwidth,
        link_latency=hw.inter_latency,
        memory_bandwidth=hw.adam_params_per_thread_s * ADAM_BYTES_PER_PARAM,
        param_bytes=4.0 if precision == "fp32" else 2.0,
    )


def op_host_seconds(cfg: SysxConfig) -> float:
    """Modelled seconds of the real host work of one executor instruction: ``emulate.op_host_us``
    (null: this machine's cached figure, :func:`~sysx.machine.hardware_cache.cached_op_host_s`)
    divided by the time scale (the host works in wall time; a modelled second lasts ``time_scale``)."""
    e = cfg.emulate
    wall = cached_op_host_s() if e.op_host_us is None else e.op_host_us * 1e-6
    return wall / e.time_scale


def emulated_costs(
    hw: EmulatedCluster,
    model: EmulatedModel,
    *,
    precision: str,
    workers: int,
    async_optimizer: bool,
    replica: ReplicaCosts | None = None,
    op_host: float = 0.0,
) -> Costs:
    """:func:`costs_from_model` of ``model`` on ``hw`` (see the module doc for sends and workers),
    with ``replica``'s data-parallel replicas and ``op_host`` modelled seconds per instruction."""
    work = "float32" if precision == "fp32" else "bfloat16"
    per_worker = hw.adam_params_per_thread_s * hw.threads_per_rank / (workers if async_optimizer else 1)
    return costs_from_model(
        model.config,
        model.seq_len,
        model.micro_batch_size,
        gpu_flops=hw.gpu_flops,
        dtype_bytes=4 if precision == "fp32" else 2,
        host_bytes_per_param=float(training_state_bytes(work).optimizer),
        p2p_bandwidth=hw.intra_bandwidth,
        p2p_latency=hw.intra_latency,
        h2d_bandwidth=hw.h2d_bandwidth,
        d2h_bandwidth=hw.d2h_bandwidth,
        optim_params_per_s=per_worker,
        optim_workers=workers if async_optimizer else None,
        posted_sends=True,
        gpus_per_node=hw.gpus_per_node,
        inter_p2p_bandwidth=hw.inter_bandwidth,
        inter_p2p_latency=hw.inter_latency,
        replica=replica,
        op_host=op_host,
    )


def tier_costs(
    hw: EmulatedCluster, table: CostTable, schedule: Schedule, *, precision: str, workers: int = 1
) -> tuple[CostTable, DiskCosts]:
    """``table`` with the optimizer states on the node's drives (``optim.offload=nvme``): host bytes
    per parameter without them, every rank's staging pool (:func:`~sysx.memory.budget.staging_bytes`
    of its largest sub-stage) in its process bytes; and the tier's :class:`DiskCosts`: each step
    reads and writes the master, m and v (fp32: m and v) at each rank's share of the node's drives,
    through one staging buffer per optimizer worker and two more (the tier's pool,
    :func:`~sysx.memory.budget.tier_staging_buffers`); 16-bit gradients are converted per job into a
    per-rank fp32 pool (:func:`~sysx.memory.budget.grad_scratch_bytes`, the busiest rank's), not per parameter."""
    slots = tier_staging_buffers(workers)
    work = "float32" if precision == "fp32" else "bfloat16"
    tier = training_state_bytes(work, offload="nvme")
    disk = disk_costs(
        table,
        state_bytes_per_param=tier.step_io,
        read_bandwidth=hw.disk_read_bandwidth,
        write_bandwidth=hw.disk_write_bandwidth,
        ranks_per_node=min(hw.gpus_per_node, schedule.n_ranks * table.replicas),
        slots=slots,
    )
    largest = int(max(table.params_sub, default=0.0) / table.replicas)
    d, place = table.split, schedule.assignment
    owned = [
        [int(table.params_sub[s * d + k] / table.replicas) for s, k in place.bwd_substages(x)]
        for x in range(schedule.n_ranks)
    ]
    grads = max((grad_scratch_bytes(o, work, workers=workers) for o in owned), default=0)
    table = dataclasses.replace(
        table,
        host_bytes_per_param=float(tier.optimizer),
        process_bytes=table.process_bytes + staging_bytes(largest, work, workers=workers) + grads,
    )
    return table, disk


def plan_emulation(
    cfg: SysxConfig, schedule: Schedule, *, backend: str, replicas: int | None = None, nvme: bool | None = None
) -> EmulatedPlan:
    """The emulated plan of ``schedule`` (built from :func:`emulated_model`'s layers), run by
    ``replicas`` pipelines (None: ``parallel.replicas``), with the optimizer states on the node's
    NVMe drives when ``nvme`` (None: ``optim.offload=nvme``; :mod:`sysx.schedule.disk`). Raises
    :class:`ConfigError` when a rank's planned GPU memory exceeds the emulated GPU's."""
    hw, model = cluster(cfg.emulate), emulated_model(cfg)
    workers = optimizer_workers(hw, schedule, backend=backend, workers=cfg.optim.workers)
    replica = replica_costs(
        hw, cfg.parallel.count if replicas is None else replicas, schedule.n_ranks, precision=cfg.precision
    )
    costs = emulated_costs(
        hw,
        model,
        precision=cfg.precision,
        workers=workers,
        async_optimizer=schedule.options.async_optimizer,
        replica=replica,
        op_host=op_host_seconds(cfg),
    )
    table = costs.table(schedule)
    disk = None
    if cfg.optim.offload == "nvme" if nvme is None else nvme:
        table, disk = tier_costs(hw, table, schedule, precision=cfg.precision, workers=workers)
    timeline = simulate(schedule, table, gpus_per_node=hw.gpus_per_node)
    worst = max(range(schedule.n_ranks), key=lambda r: timeline.peak_gpu[r])
    if timeline.peak_gpu[worst] > hw.gpu_memory_bytes:
        parts = zip(
            ("parameters", "gradients", "checkpoints", "activations"),
            (timeline.peak_params, timeline.peak_grads, timeline.peak_ckpts, timeline.peak_work),
        )
        raise ConfigError(
            f"emulate.gpu={hw.gpu} has {hw.gpu_memory_bytes / GIB:g} GiB but {schedule.name} of {model.name} at "
            f"{model.micro_batch_size}x{model.seq_len} tokens per micro-batch needs {timeline.peak_gpu[worst] / GIB:.1f} GiB "
            f"on rank {worst} (peaks: " + ", ".join(f"{n} {p[worst] / GIB:.1f}" for n, p in parts) + "); lower "
            "emulate.micro_batch_size or emulate.seq_len, or use a GPU with more memory"
        )
    io = with_disk(schedule, timeline, table, disk) if disk is not None else None
    return EmulatedPlan(hw, model, costs, table, timeline, workers, disk, io)


LaneTimes = Mapping[tuple[int, int], tuple[float, float, float]]  # a rank's device-lane sub-stages: (in, step, out) s


def device_lane_plan(plan: EmulatedPlan, schedule: Schedule, device: Sequence[LaneTimes]) -> tuple[float, float]:
    """The planned (iteration, bubble ratio) with ``device[r]``'s sub-stages of each rank on the
    device lane (``optim.placement``), as the runtime and the pacer run them: those sub-stages take
    no CPU worker (the table's optimizer cost 0), and after the VALIDATE barrier each rank's lane
    copies them in, steps and copies them out on its three engines
    (:func:`~sysx.optim.placement.device_flow`, in the order given) before its next step starts."""
    d = plan.table.split
    on = {s * d + k for lane in device for s, k in lane}
    table = dataclasses.replace(plan.table, opt=[0.0 if i in on else c for i, c in enumerate(plan.table.opt)])
    timeline = simulate(schedule, table, record=False, memory=False, gpus_per_node=plan.cluster.gpus_per_node)
    # every rank's list ends with VALIDATE (a barrier): its lane starts at the iteration's end
    lanes = [device_flow(timeline.iteration, list(lane.values())) for lane in device]
    iteration = max([timeline.iteration, *(ends[-1] for ends in lanes if ends)])
    busy, ranks = sum(timeline.busy), schedule.n_ranks
    return iteration, (iteration * ranks - busy) / (iteration * ranks) if iteration > 0 else 0.0
