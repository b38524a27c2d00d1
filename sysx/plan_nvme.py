"""``sysx plan --offload nvme``: what the NVMe tier costs the planned pipeline job, node by node.

For the planned schedule and model: each node's state files, its host memory with and without
the tier, the bytes through its drives per step, the I/O the step cannot hide
and the global batch from which the disk hides behind compute, and the largest model a node holds
with and without the tier (:mod:`sysx.machine.disk_plan`, shared with ``sysx plan-single``).

With a model's costs, the exposed I/O is the disk lane's replay of the simulated step
(:func:`sysx.schedule.disk.with_disk`, the model the emulated device charges and its measurements
matched within 1%), and the disk hides from the fewest micro-batches whose replayed exposed I/O is
within :data:`HIDE_TOLERANCE` of the step. The whole-step bound of :mod:`sysx.optim.nvme.cost`
(``max(0, read_s + write_s - step_s)``, the plan simulated again at twice the micro-batches for the
step's growth) is the fallback without a model: it is blind to the staging pool's read-ahead depth
and says too small a batch (30B on the emulated node: 13 micro-batches, where the replay and the
measurement say 17).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from sysx.config.checks import first_line
from sysx.machine.disk_plan import disk_room, io_lines, largest_lines, step_figures
from sysx.memory.budget import HostMemoryPlan, fmt_bytes, tier_staging_buffers, training_state_bytes
from sysx.memory.node_plan import node_host_memory
from sysx.optim.nvme.cost import DiskRates, StepIo
from sysx.partition import PartitionError
from sysx.replicas import ReplicaLayout
from sysx.schedule.costs import CostTable, model_layer_params
from sysx.schedule.disk import DiskTimeline, disk_costs, hiding_point, with_disk
from sysx.schedule.ops import Schedule, ScheduleError
from sysx.schedule.replica_costs import schedule_units
from sysx.schedule.simulate import Timeline

HIDE_TOLERANCE = 0.01  # the disk hides once the replayed exposed I/O is within 1% of the step
HIDE_SEARCH = 64  # how far past the planned micro-batches the hiding batch is searched (each count is a replan)
Plan = tuple[Schedule, Timeline, CostTable | None]  # a schedule, its simulated step and its costs (None: unit costs)
Replan = Callable[[int], Plan]  # the same plan at another count of micro-batches per replica


def node_plans(
    sched: Schedule, layer_numels: Sequence[float], replicas: int, gpus_per_node: int, dtype: str, offload: str
) -> list[HostMemoryPlan]:
    """Every node's host-memory plan of ``replicas`` pipelines running ``sched`` under ``offload``."""
    layout = ReplicaLayout(replicas, sched.n_ranks, 0, local_world_size=gpus_per_node)
    units = schedule_units(sched, layer_numels)
    nodes = -(-layout.world_size // gpus_per_node)
    return [node_host_memory(units, layout, n, dtype, offload=offload) for n in range(nodes)]


def tier_lines(args: argparse.Namespace, sched: Schedule, tl: Timeline, replan: Replan) -> list[str]:
    """The tier's section of ``sysx plan`` (see the module doc); ``replan(m)``: the plan's timeline at
    ``m`` micro-batches per replica."""
    disk: DiskRates = args.disk
    got = tier_summary(args, sched, tl, replan)
    lines = [f"NVMe tier (optim.offload=nvme), each node's drives: {disk.describe()}"]
    for n, node in enumerate(got["nodes"]):
        lines.append(
            f"  node {n}: state files {fmt_bytes(node['state_files'])}{disk_room(disk, node['state_files'])}, "
            f"host memory {fmt_bytes(node['host'])} (without the tier {fmt_bytes(node['host_without_tier'])}); "
            f"per step read {fmt_bytes(node['step_io'])}, write {fmt_bytes(node['step_io'])}"
        )
    io = StepIo(got["read_s"], got["write_s"], got["step_s"], got["replayed_exposed_s"])
    per = args.replicas * args.micro_batch_size
    hide = got["hides_from_global_batch"]
    lines += io_lines(io, hide and hide // per, args.microbatches, sequences_per=per, where=" (busiest node)")
    if got["not_planned"]:
        lines[-1] = f"  the batch at which the disk hides is not planned: {got['not_planned']}"
    dtype = "float32" if args.precision == "fp32" else "bfloat16"
    return lines + largest_lines(args, dtype, disk, got["staging_per_param"])


def tier_summary(args: argparse.Namespace, sched: Schedule, tl: Timeline, replan: Replan) -> dict[str, Any]:
    """The figures of :func:`tier_lines` as plain data (``sysx plan --json``'s ``nvme``)."""
    dtype = "float32" if args.precision == "fp32" else "bfloat16"
    gpn = args.gpus_per_node or args.world
    numels = model_layer_params(args.model_cfg)
    plain = node_plans(sched, numels, args.replicas, gpn, dtype, "host")
    tier = node_plans(sched, numels, args.replicas, gpn, dtype, "nvme")
    m, per = args.microbatches, args.replicas * args.micro_batch_size
    nbytes = max(t.step_io for t in tier)
    why: str | None = None
    if args.table is not None:
        io = step_figures(args.disk, nbytes, (m, tl.iteration), (m, tl.iteration))[0]
        io = dataclasses.replace(io, replayed_exposed_s=replayed(args, sched, tl, args.table, dtype).exposed)
        hide, why = _replayed_hide(args, replan, dtype)
    else:
        more, why = _grown(replan, m)
        io, hide = step_figures(args.disk, nbytes, (m, tl.iteration), more or (m, tl.iteration))
    return {
        "read_bytes_per_s": args.disk.read_bytes_per_s,
        "write_bytes_per_s": args.disk.write_bytes_per_s,
        "free_bytes": args.disk.free_bytes,
        "nodes": [
            {"state_files": t.disk, "host": t.total, "host_without_tier": p.total, "step_io": t.step_io}
            for p, t in zip(plain, tier, strict=True)
        ],
        "read_s": io.read_s,
        "write_s": io.write_s,
        "step_s": io.step_s,
        "exposed_s": io.exposed_s,
        "replayed_exposed_s": io.replayed_exposed_s,  # None: the whole-step bound (unit costs)
        "hides_from_global_batch": None if hide is None else hide * per,
        "not_planned": why,  # why the batch at which the disk hides is not planned (None: it is)
        "staging_per_param": sum(_pools(p, t, dtype) for p, t in zip(plain, tier, strict=True)) / sum(numels),
    }


def _pools(plain: HostMemoryPlan, tier: HostMemoryPlan, dtype: str) -> int:
    """A node's bytes with the tier that the per-parameter cost (:func:`~sysx.optim.nvme.cost.state_bytes_per_param`)
    leaves out: the staging pools and, in 16-bit runs, the fp32 gradients (the ranks' scratch pools, or
    with replicas their fp32 shards)."""
    return tier.pinned - plain.pinned + (tier.grads if dtype != "float32" else 0)


def replayed(args: argparse.Namespace, sched: Schedule, tl: Timeline, table: CostTable, dtype: str) -> DiskTimeline:
    """The step ``tl`` with its optimizer jobs' state moved through the node's drives (``args.disk``,
    shared by the node's ranks) and the tier's staging pool at one optimizer worker per rank."""
    ranks_per_node = min(args.gpus_per_node or args.world, sched.n_ranks * args.replicas)
    disk = disk_costs(
        table,
        state_bytes_per_param=training_state_bytes(dtype, offload="nvme").step_io,
        read_bandwidth=args.disk.read_bytes_per_s,
        write_bandwidth=args.disk.write_bytes_per_s,
        ranks_per_node=ranks_per_node,
        slots=tier_staging_buffers(1),
    )
    return with_disk(sched, tl, table, disk)


def _replayed_hide(args: argparse.Namespace, replan: Replan, dtype: str) -> tuple[int | None, str | None]:
    """The fewest micro-batches per replica whose replayed exposed I/O is within :data:`HIDE_TOLERANCE`
    of the step (searched up to :data:`HIDE_SEARCH` times the planned count), or ``(None, why)``."""
    limit, failed = HIDE_SEARCH * args.microbatches, []

    def hidden(m: int) -> bool:
        try:
            sched, tl, table = replan(m)
        except (ValueError, PartitionError, ScheduleError) as err:  # a count this layout cannot run
            failed.append(f"{m} micro-batches: {first_line(err)}")
            return False
        assert table is not None, "a model's plan has a cost table"
        io = replayed(args, sched, tl, table, dtype)
        return io.exposed <= HIDE_TOLERANCE * io.base

    hide = hiding_point(hidden, start=1, limit=limit)
    if hide is not None:
        return hide, None
    return None, failed[-1] if failed else f"the disk does not hide within {limit} micro-batches per replica"


def _grown(replan: Replan, m: int) -> tuple[tuple[int, float] | None, str | None]:
    """``(count, step seconds)`` of the plan at twice the micro-batches, else at one more (a larger
    count may not fit the GPUs); ``(None, why)`` when neither plans."""
    why = ""
    for count in dict.fromkeys((2 * m, m + 1)):
        try:
            return (count, replan(count)[1].iteration), None
        except (ValueError, PartitionError, ScheduleError) as err:
            why = first_line(err)
    return None, f"the plan at {m + 1} micro-batches fails: {why}"


def replanner(plan_one: Callable[..., tuple[Schedule, Timeline, str]], args: argparse.Namespace, name: str, cfg: int):
    """``m -> timeline`` of the same plan at ``m`` micro-batches per replica."""

    def replan(m: int) -> Plan:
        again = copy.copy(args)
        again.microbatches = m
        sched, tl, _ = plan_one(again, name, cfg, fit=False)
        return sched, tl, again.table

    return replan
