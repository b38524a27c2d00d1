"""The planners' shared view of the NVMe tier (``sysx plan``, ``sysx plan-single``): the flags
that give or measure a node's drives, and the lines that say what the disk costs a step and how
large a model a node holds with and without the tier (:mod:`sysx.optim.nvme.cost`'s arithmetic)."""

from __future__ import annotations

import argparse

from sysx.config.choices import OFFLOADS
from sysx.machine.disk_cache import load_or_measure_disk
from sysx.memory.budget import fmt_bytes
from sysx.model import PRESETS, get_preset
from sysx.optim.nvme.cost import GB, DiskRates, Fit, StepIo, largest_model, micro_batches_to_hide, step_io

GIB = float(1 << 30)


def add_disk_arguments(p: argparse.ArgumentParser, *, host_flag: bool = True) -> None:
    """The ``--offload`` group: the tier on or off and the node's drives, given or measured;
    ``host_flag``: add ``--host-gb`` (``sysx plan-single`` has its own, the host budget)."""
    g = p.add_argument_group("NVMe tier (optim.offload=nvme)")
    g.add_argument(
        "--offload", choices=OFFLOADS, default=None, help="nvme: plan the fp32 optimizer state on disk (default host)"
    )
    g.add_argument(
        "--nvme-dir", default=None, help="the state files' directory: its drive is measured once (cached), free read"
    )
    g.add_argument("--nvme-engine", default=None, help="the I/O engine measured: auto (default) | aio | threads")
    g.add_argument("--disk-read-gbps", type=float, default=None, help="assumed read GB/s of one node's drives")
    g.add_argument("--disk-write-gbps", type=float, default=None, help="assumed write GB/s (default the read figure)")
    g.add_argument("--disk-gb", type=float, default=None, help="free disk per node in GiB (default: --nvme-dir's)")
    if host_flag:
        g.add_argument(
            "--host-gb", type=float, default=None, help="host memory per node in GiB (default this machine's)"
        )


def resolve_disk(args: argparse.Namespace, job_optim: object | None = None) -> None:
    """``--offload``/``--nvme-dir``/``--nvme-engine`` from a job's ``optim`` section where the flags
    leave them unset; sets ``args.disk``: the node's drives (None without the tier). A one-line
    ValueError when the tier has no rates to plan with."""
    args.offload = args.offload or getattr(job_optim, "offload", None) or "host"
    args.nvme_dir = args.nvme_dir or getattr(job_optim, "nvme_dir", None)
    args.nvme_engine = args.nvme_engine or getattr(job_optim, "nvme_engine", None) or "auto"
    args.disk = None
    if args.offload != "nvme":
        return
    if args.disk_read_gbps is not None:
        write = args.disk_write_gbps or args.disk_read_gbps
        free = None if args.disk_gb is None else int(args.disk_gb * GIB)
        args.disk = DiskRates(args.disk_read_gbps * GB, write * GB, free, "assumed")
    elif args.nvme_dir:
        try:
            args.disk, _ = load_or_measure_disk(args.nvme_dir, args.nvme_engine)
        except FileNotFoundError as err:
            raise ValueError(str(err)) from None
        if args.disk_gb is not None:
            args.disk = DiskRates(args.disk.read_bytes_per_s, args.disk.write_bytes_per_s, int(args.disk_gb * GIB))
    else:
        raise ValueError("--offload nvme needs --nvme-dir DIR (measured once) or --disk-read-gbps/--disk-write-gbps")


def disk_room(disk: DiskRates, need: int) -> str:
    """`` (does not fit: 27.4 GiB free)`` when ``need`` bytes of state files exceed the drives' known free space."""
    if disk.free_bytes is None or need <= disk.free_bytes:
        return ""
    return f" (does not fit: {fmt_bytes(disk.free_bytes)} free)"


def step_figures(
    disk: DiskRates, nbytes: int, step: tuple[int, float], more: tuple[int, float]
) -> tuple[StepIo, int | None]:
    """The step's I/O moving ``nbytes`` each way through ``disk`` and the count from which it hides
    (None: never); ``step``/``more``: ``(count, step seconds)`` at the planned count and a larger one."""
    io = step_io(nbytes, nbytes, disk, step[1])
    return io, micro_batches_to_hide(io.io_s, step, more)


def io_lines(io: StepIo, hide: int | None, planned: int, *, sequences_per: int = 1, where: str = "") -> list[str]:
    """The exposed I/O of a step (``where``: " (busiest node)") and the global batch from which the disk
    hides; ``hide`` and ``planned``: counts (:func:`step_figures`), each ``sequences_per`` sequences of
    the global batch (a micro-batch of every replica)."""
    head = f"  exposed I/O per step{where}: {io.describe()}"
    if hide is None:
        return [head, "  the step does not grow with the batch: the disk never hides"]
    counts = f" ({hide} micro-batches per replica)" if sequences_per > 1 else ""
    return [
        head,
        f"  the disk hides behind compute from a global batch of {hide * sequences_per} sequences{counts} "
        f"(planned: {planned * sequences_per})",
    ]


def largest_lines(
    args: argparse.Namespace, dtype: str, disk: DiskRates | None, staging: float = 0.0, *, window: bool = False
) -> list[str]:
    """The largest model one node holds with and without the tier (host memory: ``--host-gb`` or this
    machine's total; disk: ``--disk-gb`` or the directory's free space; ``staging``: the plan's
    per-rank pools (tier staging; the pipeline's 16-bit runs: fp32 gradients too) per parameter, which scale with the model at the same layout; ``window``: the
    sliding window's state, else the pipeline's)."""
    if args.host_gb:  # None or 0: this machine's
        host = args.host_gb * GIB
    else:
        import psutil

        host = float(psutil.virtual_memory().total)
    free = None if disk is None else disk.free_bytes
    plain, tier = largest_model(host, free, dtype, staging_per_param=staging, window=window)
    where = f"a node of {fmt_bytes(host)} host memory" + ("" if free is None else f" and {fmt_bytes(free)} free disk")
    with_tier = "give --disk-gb or --nvme-dir for the disk's bound" if tier is None else _fit(tier)
    pools = f" ({staging:.1f} bytes/param of per-rank buffer pools at this layout)" if staging else ""
    return [
        f"  largest model whose training state fits {where}: without the tier {_fit(plain)}; with it {with_tier}{pools}"
    ]


def _fit(fit: Fit) -> str:
    """``6.9B parameters (bound by host memory; largest preset llama2_7b)``."""
    from sysx.schedule.costs import model_layer_params

    sizes = {name: sum(model_layer_params(get_preset(name))) for name in PRESETS}
    fitting = [name for name, n in sorted(sizes.items(), key=lambda kv: kv[1]) if n <= fit.params]
    preset = f"; largest preset {fitting[-1]}" if fitting else ""
    return f"{fit.params / 1e9:.1f}B parameters (bound by {fit.limit}{preset})"
