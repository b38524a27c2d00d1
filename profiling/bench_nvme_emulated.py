"""The NVMe tier (``optim.offload=nvme``) on the emulated node, measured by the real runtime beside its plan.

Issue 28's case: a 30B Llama (``llama2_30b``) on ONE node of 4 emulated GPUs with 256 GiB of host
memory (``emulate.host_memory_gib=256``) and 4 NVMe drives (``emulate.disk=nvme3x4``: 3.5 GB/s read,
3.0 GB/s write each, shared by the node's ranks). The host-memory run does not fit that node (its
plan says how far over); with the tier the fp32 master, m and v live on the drives. For each global
batch (``--micro-batches``) it plans both (``sysx.emulate.costs.plan_emulation``: the simulator, and
for the tier :func:`sysx.schedule.disk.with_disk`), searches the batch at which the disk hides
(planned exposed I/O within ``--hide-tolerance`` of the step), then runs the cells with the real
runtime on the emulated device (``profiling/bench_pipeline.py``'s launcher and worker: 4 processes,
``--steps`` steps of which ``--warmup`` are not measured, a refused measurement retried ``--retries``
times) and prints one Markdown table: planned and measured s/it, measured/planned, the planned
exposed I/O per step (the tier's iteration less the host-memory plan's), the measured one (the
tier's measured iteration less the host-memory run's, measured beside it: ``--offloads host,nvme``) and
the measured wait of the steps for their reads (the busiest rank, the pacer's spans)::

    PYTHONPATH=. python profiling/bench_nvme_emulated.py --micro-batches 16,32 --steps 4 --time-scale 0.1 \\
        --retries 2 --json profiling/results/bench_nvme_emulated_<date>.jsonl
    PYTHONPATH=. python profiling/bench_nvme_emulated.py --plan-only      # the plans, running nothing
    PYTHONPATH=. python profiling/bench_nvme_emulated.py --report a.jsonl b.jsonl   # tables of kept runs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pipeline as bp  # the launcher and worker of the emulated cells

GiB = float(1 << 30)


def overrides(args: argparse.Namespace, micro: int, offload: str, nvme_dir: str) -> dict[str, Any]:
    """The config keys of one cell beyond bench_pipeline's."""
    out: dict[str, Any] = {
        "train.micro_batches": micro,
        "optim.offload": offload,
        "optim.placement": "cpu",  # the tier steps on the CPU lane (the device lane is not in the disk model)
        "emulate.host_memory_gib": args.host_memory_gib,
        "emulate.disk": args.disk,
    }
    if offload == "nvme":
        out["optim.nvme_dir"] = nvme_dir
    return out


def plan(args: argparse.Namespace, micro: int, offload: str) -> Any:
    """The emulated plan of one cell (``plan_emulation``)."""
    from sysx.emulate.costs import emulated_model, plan_emulation
    from sysx.runtime.options import make_schedule

    cfg, opts = bp._cell_config(
        args.model, args.seq, args.ranks, args.schedule, shared(args), 1, overrides(args, micro, offload, "/tmp")
    )
    em = emulated_model(cfg)
    sched = make_schedule(
        opts,
        em.config,
        n_ranks=args.ranks,
        n_micro=micro,
        seq_len=em.seq_len,
        ranks_per_node=bp.GPUS_PER_NODE,
        micro_batch_size=cfg.train.micro_batch_size,
        spread_allowed=offload == "host",  # as the run: the NVMe tier keeps the last step on its owner
    )
    return plan_emulation(cfg, sched, backend="torch")


def node_host(p: Any) -> float:
    """The node's planned host bytes: every rank's private state and the shared working copy."""
    return sum(p.timeline.host) + sum(p.timeline.shm)


def hides(args: argparse.Namespace, micro: int) -> bool:
    """The planned exposed I/O at ``micro`` micro-batches is within the tolerance of the step."""
    io = plan(args, micro, "nvme").disk_timeline
    return io is not None and io.exposed <= args.hide_tolerance * io.base


def plan_lines(args: argparse.Namespace, micros: list[int]) -> tuple[list[str], int | None]:
    """One line per batch: the host and tier plans, and the batch at which the disk hides."""
    from sysx.schedule.disk import hiding_point

    lines = []
    for m in micros:
        host, tier = plan(args, m, "host"), plan(args, m, "nvme")
        io = tier.disk_timeline
        lines.append(
            f"| {m} | {m * args.micro_batch_size} | {host.timeline.iteration:.2f} | {tier.iteration:.2f} | "
            f"{io.exposed:.2f} | {max(io.wait):.2f} | {io.busy:.2f} | {node_host(host) / GiB:.0f} | "
            f"{node_host(tier) / GiB:.0f} |"
        )
    return lines, hiding_point(lambda m: hides(args, m), start=1, limit=4096)


def shared(args: argparse.Namespace) -> dict[str, Any]:
    """bench_pipeline's per-run arguments."""
    return {
        "steps": args.steps,
        "warmup": args.warmup,
        "time_scale": args.time_scale,
        "gpu": args.gpu,
        "optimizer_workers": 1,
        "spans": False,
        "retries": args.retries,
    }


def measured_table(rows: list[dict[str, Any]], micro_batch_size: int) -> str:
    """The measured cells beside their plans."""
    host = {r["set"]["train.micro_batches"]: r for r in rows if r["set"]["optim.offload"] == "host"}
    lines = [
        "| micro-batches | global batch (seqs) | offload | planned s/it | measured s/it | measured/planned | "
        "planned exposed I/O s | measured exposed I/O s | planned read wait s | measured read wait s | runs |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        m, off = r["set"]["train.micro_batches"], r["set"]["optim.offload"]
        rep = r.get("report") or {}
        meas = rep.get("measured")
        head = f"| {m} | {m * micro_batch_size} | {off} | {rep.get('plan', {}).get('iteration_s', 0):.2f} |"
        if meas is None:
            lines.append(
                head
                + f" refused: {str(rep.get('refused') or r.get('error'))[:60]} | | | | | | {r.get('attempts', 1)} |"
            )
            continue
        nv = rep.get("nvme") or {}
        base = host.get(m)
        base_it = ((base or {}).get("report") or {}).get("measured") or {}
        exposed = f"{meas['iteration_s'] - base_it['iteration_s']:.2f}" if off == "nvme" and base_it else ""
        lines.append(
            head
            + f" {meas['iteration_s']:.2f} | {meas['over_plan']:.3f} | "
            + (
                f"{nv['plan_exposed_s']:.2f} | {exposed} | {nv['plan_wait_s']:.2f} | {nv['wait_s']:.2f} |"
                if nv
                else " | | | |"
            )
            + f" {r.get('attempts', 1)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama2_30b", help="the emulated preset")
    p.add_argument("--ranks", type=int, default=4, help="ranks (GPUs) of the one node")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--schedule", default="sysx:cfg3")
    p.add_argument("--micro-batches", default="16,32", help="comma list: micro-batches per step, one cell each")
    p.add_argument("--host-memory-gib", type=float, default=256.0)
    p.add_argument("--disk", default="nvme3x4", help="emulate.disk (sysx.config.choices.ASSUMED_DISKS)")
    p.add_argument("--gpu", default="v100", choices=list(bp.GPUS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--time-scale", type=float, default=0.1)
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--offloads", default="host,nvme", help="comma list: run every batch with these optim.offload")
    p.add_argument("--hide-tolerance", type=float, default=0.01, help="exposed I/O / step counted as hidden")
    p.add_argument("--plan-only", action="store_true")
    p.add_argument("--json", type=Path, help="keep every measured cell here (JSON lines)")
    p.add_argument(
        "--report",
        type=Path,
        nargs="+",
        help="print the table of --json files kept before (a cell run again: its last row)",
    )
    args = p.parse_args(argv)
    if args.report:
        kept = {}
        for path in args.report:
            for line in path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    kept[(r["set"]["train.micro_batches"], r["set"]["optim.offload"])] = r
        print(measured_table([kept[k] for k in sorted(kept)], bp.MICRO_BATCH))
        return 0
    args.micro_batch_size = bp.MICRO_BATCH
    micros = [int(x) for x in args.micro_batches.split(",")]
    lines, hide = plan_lines(args, micros)
    header = (
        "| micro-batches | global batch (seqs) | host plan s/it | tier plan s/it | exposed I/O s | read wait s "
        "(busiest rank) | disk busy s/rank | node host GiB, host | node host GiB, tier |\n" + "|---" * 9 + "|"
    )
    print(f"plan: {args.model} on {args.ranks} x {args.gpu}, {args.host_memory_gib:g} GiB, {args.disk}")
    print(header + "\n" + "\n".join(lines))
    print(
        f"\nthe disk hides (planned exposed I/O <= {100 * args.hide_tolerance:g}% of the step) from {hide} "
        f"micro-batches = {hide * args.micro_batch_size if hide else None} sequences per step"
    )
    if args.plan_only:
        return 0
    out = args.json or Path(tempfile.mkstemp(suffix=".jsonl")[1])
    out.write_text("")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sysx-nvme-bench-") as nvme_dir:
        cells = [
            {"model": args.model, "seq": args.seq, "schedule": args.schedule, "set": overrides(args, m, off, nvme_dir)}
            for m in micros
            for off in args.offloads.split(",")
        ]
        bp.launch(cells, args.ranks, shared(args), out)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    print(f"\nmeasured ({len(rows)} cells in {time.perf_counter() - t0:.0f} s):")
    print(measured_table(rows, args.micro_batch_size))
    if not args.json:
        out.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
