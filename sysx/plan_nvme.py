"""``sysx plan --offload nvme``: what the NVMe tier costs the planned pipeline job, node by node.

For the planned schedule and model: each node's state files, its host memory with and without
the tier, the bytes through its drives per step, the I/O the step cannot hide
(:mod:`sysx.optim.nvme.cost`'s one-queue overlap model: ``max(0, read_s + write_s - step_s)``),
the global batch from which the disk hides behind compute (the plan simulated again at twice
the micro-batches gives the step's growth per micro-batch), and the largest model a node holds
with and without the tier (:mod:`sysx.machine.disk_plan`, shared with ``sysx plan-single``).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from typing import Any

from sysx.config.checks import first_line
from sysx.machine.disk_plan import disk_room, io_lines, largest_lines, step_figures
from sysx.memory.budget import HostMemoryPlan, fmt_bytes
from sysx.memory.node_plan import node_host_memory
from sysx.optim.nvme.cost import DiskRates, StepIo
from sysx.partition import PartitionError
from sysx.replicas import ReplicaLayout
from sysx.schedule.costs import model_layer_params
from sysx.schedule.ops import Schedule, ScheduleError
from sysx.schedule.replica_costs import schedule_units
from sysx.schedule.simulate import Timeline


def node_plans(
    sched: Schedule, layer_numels: Sequence[float], replicas: int, gpus_per_node: int, dtype: str, offload: str
) -> list[HostMemoryPlan]:
    """Every node's host-memory plan of ``replicas`` pipelines running ``sched`` under ``offload``."""
    layout = ReplicaLayout(replicas, sched.n_ranks, 0, local_world_size=gpus_per_node)
    units = schedule_units(sched, layer_numels)
    nodes = -(-layout.world_size // gpus_per_node)
    return [node_host_memory(units, layout, n, dtype, offload=offload) for n in range(nodes)]


def tier_lines(args: argparse.Namespace, sched: Schedule, tl: Timeline, replan: Callable[[int], Timeline]) -> list[str]:
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
    io = StepIo(got["read_s"], got["write_s"], got["step_s"])
    per = args.replicas * args.micro_batch_size
    hide = got["hides_from_global_batch"]
    lines += io_lines(io, hide and hide // per, args.microbatches, sequences_per=per, where=" (busiest node)")
    if got["not_planned"]:
        lines[-1] = f"  the batch at which the disk hides is not planned: {got['not_planned']}"
    dtype = "float32" if args.precision == "fp32" else "bfloat16"
    return lines + largest_lines(args, dtype, disk, got["staging_per_param"])


def tier_summary(
    args: argparse.Namespace, sched: Schedule, tl: Timeline, replan: Callable[[int], Timeline]
) -> dict[str, Any]:
    """The figures of :func:`tier_lines` as plain data (``sysx plan --json``'s ``nvme``)."""
    dtype = "float32" if args.precision == "fp32" else "bfloat16"
    gpn = args.gpus_per_node or args.world
    numels = model_layer_params(args.model_cfg)
    plain = node_plans(sched, numels, args.replicas, gpn, dtype, "host")
    tier = node_plans(sched, numels, args.replicas, gpn, dtype, "nvme")
    m, per = args.microbatches, args.replicas * args.micro_batch_size
    nbytes = max(t.step_io for t in tier)
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
        "hides_from_global_batch": None if hide is None else hide * per,
        "not_planned": why,  # why the batch at which the disk hides is not planned (None: it is)
        "staging_per_param": sum(_pools(p, t, dtype) for p, t in zip(plain, tier, strict=True)) / sum(numels),
    }


def _pools(plain: HostMemoryPlan, tier: HostMemoryPlan, dtype: str) -> int:
    """A node's bytes with the tier that the per-parameter cost (:func:`~sysx.optim.nvme.cost.state_bytes_per_param`)
    leaves out: the staging pools and, in 16-bit runs, the fp32 gradients (the ranks' scratch pools, or
    with replicas their fp32 shards)."""
    return tier.pinned - plain.pinned + (tier.grads if dtype != "float32" else 0)


def _grown(replan: Callable[[int], Timeline], m: int) -> tuple[tuple[int, float] | None, str | None]:
    """``(count, step seconds)`` of the plan at twice the micro-batches, else at one more (a larger
    count may not fit the GPUs); ``(None, why)`` when neither plans."""
    why = ""
    for count in dict.fromkeys((2 * m, m + 1)):
        try:
            return (count, replan(count).iteration), None
        except (ValueError, PartitionError, ScheduleError) as err:
            why = first_line(err)
    return None, f"the plan at {m + 1} micro-batches fails: {why}"


def replanner(plan_one: Callable[..., tuple[Schedule, Timeline, str]], args: argparse.Namespace, name: str, cfg: int):
    """``m -> timeline`` of the same plan at ``m`` micro-batches per replica."""

    def replan(m: int) -> Timeline:
        again = copy.copy(args)
        again.microbatches = m
        return plan_one(again, name, cfg, fit=False)[1]

    return replan
