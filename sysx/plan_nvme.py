"""``sysx plan --offload nvme``: what the NVMe tier costs the planned job, node by node.

For the planned schedule and model: each node's state files, its host memory with and without
the tier, the bytes through its drives per step, the I/O the step cannot hide
(:mod:`sysx.optim.nvme.cost`'s one-queue overlap model: ``max(0, read_s + write_s - step_s)``),
the global batch from which the disk hides behind compute (the plan simulated again at twice
the micro-batches gives the step's growth per micro-batch), and the largest model a node holds
with and without the tier. The drives' rates are measured once per machine and drive
(``--nvme-dir``, :mod:`sysx.machine.disk_cache`) or given (``--disk-read-gbps``/``--disk-write-gbps``).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence

from sysx.config.choices import OFFLOADS
from sysx.memory.budget import HostMemoryPlan, fmt_bytes
from sysx.memory.node_plan import node_host_memory
from sysx.model import PRESETS, get_preset
from sysx.optim.nvme.cost import GB, DiskRates, Fit, largest_model, micro_batches_to_hide, step_io
from sysx.replicas import ReplicaLayout
from sysx.schedule.costs import model_layer_params
from sysx.schedule.ops import Schedule
from sysx.schedule.replica_costs import schedule_units
from sysx.schedule.simulate import Timeline

GIB = float(1 << 30)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--offload`` group of ``sysx plan`` (and ``sysx plan-single``)."""
    g = p.add_argument_group("NVMe tier (optim.offload=nvme)")
    g.add_argument(
        "--offload", choices=OFFLOADS, default=None, help="nvme: plan the fp32 optimizer state on disk (default host)"
    )
    g.add_argument(
        "--nvme-dir", default=None, help="the state files' directory: its drive is measured once (cached), free read"
    )
    g.add_argument("--disk-read-gbps", type=float, default=None, help="assumed read GB/s of one node's drives")
    g.add_argument("--disk-write-gbps", type=float, default=None, help="assumed write GB/s (default the read figure)")
    g.add_argument("--disk-gb", type=float, default=None, help="free disk per node in GiB (default: --nvme-dir's)")
    g.add_argument("--host-gb", type=float, default=None, help="host memory per node in GiB (default this machine's)")


def resolve(args: argparse.Namespace, job_offload: str | None = None, job_dir: str | None = None) -> None:
    """``--offload``/``--nvme-dir`` from the Hydra job's ``optim.*`` where the flags leave them unset;
    ``args.disk``: the node's drives (None without the tier). A one-line ValueError without rates."""
    args.offload = args.offload or job_offload or "host"
    args.nvme_dir = args.nvme_dir or job_dir
    args.disk = None
    if args.offload != "nvme":
        return
    if args.disk_read_gbps is not None:
        write = args.disk_write_gbps or args.disk_read_gbps
        free = None if args.disk_gb is None else int(args.disk_gb * GIB)
        args.disk = DiskRates(args.disk_read_gbps * GB, write * GB, free, "assumed")
    elif args.nvme_dir:
        from sysx.machine.disk_cache import load_or_measure_disk

        try:
            args.disk, _ = load_or_measure_disk(args.nvme_dir)
        except FileNotFoundError as err:
            raise ValueError(str(err)) from None
    else:
        raise ValueError("--offload nvme needs --nvme-dir DIR (measured once) or --disk-read-gbps/--disk-write-gbps")


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
    dtype = "float32" if args.precision == "fp32" else "bfloat16"
    gpn = args.gpus_per_node or args.world
    numels = model_layer_params(args.model_cfg)
    plain = node_plans(sched, numels, args.replicas, gpn, dtype, "host")
    tier = node_plans(sched, numels, args.replicas, gpn, dtype, "nvme")
    lines = [f"NVMe tier (optim.offload=nvme), each node's drives: {disk.describe()}"]
    for n, (p, t) in enumerate(zip(plain, tier, strict=True)):
        lines.append(
            f"  node {n}: state files {fmt_bytes(t.disk)}, host memory {fmt_bytes(t.total)} (without the tier "
            f"{fmt_bytes(p.total)}); per step read {fmt_bytes(t.step_io)}, write {fmt_bytes(t.step_io)}"
        )
    busiest = max(t.step_io for t in tier)
    io = step_io(busiest, busiest, disk, tl.iteration)
    lines.append(f"  exposed I/O per step (busiest node): {io.describe()}")
    m = args.microbatches
    more = replan(2 * m).iteration
    hide = micro_batches_to_hide(io.io_s, (m, tl.iteration), (2 * m, more))
    per = args.replicas * args.micro_batch_size
    lines.append(
        "  the step does not grow with micro-batches: the disk never hides"
        if hide is None
        else f"  the disk hides behind compute from {hide} micro-batches per replica: global batch "
        f"{hide * per} sequences (planned: {m * per})"
    )
    staging = sum(t.pinned - p.pinned for p, t in zip(plain, tier, strict=True)) / sum(numels)
    return lines + largest_lines(args, dtype, disk, staging)


def largest_lines(args: argparse.Namespace, dtype: str, disk: DiskRates | None, staging: float = 0.0) -> list[str]:
    """The largest model one node holds with and without the tier (host memory: ``--host-gb`` or this
    machine's total; disk: ``--disk-gb`` or the directory's free space; ``staging``: the plan's
    staging pools per parameter, which scale with the model at the same layout)."""
    if args.host_gb is not None:
        host = args.host_gb * GIB
    else:
        import psutil

        host = float(psutil.virtual_memory().total)
    free = None if disk is None else disk.free_bytes
    plain, tier = largest_model(host, free, dtype, staging_per_param=staging)
    where = f"a node of {fmt_bytes(host)} host memory" + ("" if free is None else f" and {fmt_bytes(free)} free disk")
    with_tier = "give --disk-gb or --nvme-dir for the disk's bound" if tier is None else _fit(tier)
    pools = f" ({staging:.1f} bytes/param of staging buffers at this layout)" if staging else ""
    return [f"  largest model on {where}: without the tier {_fit(plain)}; with it {with_tier}{pools}"]


def _fit(fit: Fit) -> str:
    """``6.9B parameters (bound by host memory; largest preset llama2_7b)``."""
    sizes = {name: sum(model_layer_params(get_preset(name))) for name in PRESETS}
    fitting = [name for name, n in sorted(sizes.items(), key=lambda kv: kv[1]) if n <= fit.params]
    preset = f"; largest preset {fitting[-1]}" if fitting else ""
    return f"{fit.params / 1e9:.1f}B parameters (bound by {fit.limit}{preset})"


def replanner(plan_one: Callable[..., tuple[Schedule, Timeline, str]], args: argparse.Namespace, name: str, cfg: int):
    """``m -> timeline`` of the same plan at ``m`` micro-batches per replica."""

    def replan(m: int) -> Timeline:
        again = copy.copy(args)
        again.microbatches = m
        return plan_one(again, name, cfg, fit=False)[1]

    return replan
