"""The NVMe tier on this machine's real disk (issue 28): ``optim.offload=host`` beside ``=nvme``.

For each model (``--models``: ``100m``, ``1b``) it runs the sliding-window trainer
(``schedule=single``, on this machine's CPU) a few steps with the optimizer states in host memory
and in files under ``--nvme-dir``, the two interleaved (``--rounds`` rounds of host, nvme), each in
a fresh process so its peak host memory (VmHWM) is its own, and prints one Markdown table: step
time (mean of the timed steps, ``--warmup`` left out), the tier's read and write GB/s (bytes over
the time its transfers took, issue to completion), the exposed I/O per step (the time the
optimizer jobs waited for the tier: ``TierStats.wait_s``), the step-time ratio nvme / host, and
the peak host memory of each. ``--json`` keeps the rows::

    PYTHONPATH=. python profiling/bench_nvme_tier.py --models 100m --steps 3 --nvme-dir /tmp/sysx-nvme
    PYTHONPATH=. python profiling/bench_nvme_tier.py --models 100m,1b --rounds 2 --json profiling/results/x.jsonl

The 1B host-memory run needs ~20 GB of RAM in bf16 (the fp32 master, m, v and gradients, 16 bytes a
parameter, and the working copy); run it when the machine's memory is free (``free -g``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
# ~100M and ~1B Llamas (vocabulary 8192: the byte-level default corpus needs few ids). The 1B is
# TinyLlama's shape (22 blocks, 1.03B): its host-memory run (~19 GiB) needs the 24 GiB machine to
# itself; its window gets 2 GB of "device" (host memory on CPU), so its rings stay small.
MODELS: dict[str, list[str]] = {
    "100m": ["model.dim=768", "model.n_layers=12", "model.n_heads=12", "model.n_kv_heads=12", "model.ffn_dim=2048"],
    "1b": [
        "model.dim=2048",
        "model.n_layers=22",
        "model.n_heads=16",
        "model.n_kv_heads=4",
        "model.ffn_dim=5632",
        "single.device_memory_gb=2",
    ],
}


def config_overrides(args: argparse.Namespace, model: str, offload: str, nvme_dir: str) -> list[str]:
    """The job's overrides of one run."""
    out = [
        "model=tiny",
        *MODELS[model],
        "model.vocab_size=8192",
        "model.max_seq_len=1024",
        "schedule=single",
        f"precision={args.precision}",
        f"train.seq_len={args.seq_len}",
        f"train.micro_batch_size={args.micro_batch_size}",
        "train.micro_batches=1",
        f"train.steps={args.warmup + args.steps}",
        "eval.every=0",
        "log.every=1000",
        "log.progress=false",
        f"optim.offload={offload}",
    ]
    if offload == "nvme":
        out += [f"optim.nvme_dir={nvme_dir}", f"optim.nvme_engine={args.engine}"]
    return out


def peak_host_bytes() -> int:
    """This process's peak resident memory (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def tier_of(trainer: Any) -> Any:
    """The trainer's NVMe tier (None: the states are in host memory)."""
    return getattr(trainer.host, "tier", None)


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One run in this process: warm-up steps, then timed steps one at a time."""
    import torch

    from sysx.config import load_config
    from sysx.trainers.single import SingleTrainer

    torch.manual_seed(0)
    cfg = load_config(spec["overrides"])
    trainer = SingleTrainer(cfg)
    try:
        trainer.run(spec["warmup"])
        tier = tier_of(trainer)
        before = _counters(tier)
        times = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            trainer.run(1)  # waits for the step's optimizer jobs at its end
            times.append(time.perf_counter() - t0)
        after = _counters(tier)
        row: dict[str, Any] = {"step_s": times, "params": trainer.n_params}
        if tier is not None:
            row.update({k: after[k] - before[k] for k in after}, engine=tier.engine.name, direct=tier.engine.direct)
    finally:
        trainer.close()
    row["peak_host_bytes"] = peak_host_bytes()
    return row


def _counters(tier: Any) -> dict[str, float]:
    if tier is None:
        return {}
    s = tier.stats
    return {
        "read_bytes": s.read_bytes,
        "write_bytes": s.write_bytes,
        "read_s": s.read_s,
        "write_s": s.write_s,
        "wait_s": s.wait_s,
    }


def run(args: argparse.Namespace, model: str, offload: str, nvme_dir: str) -> dict[str, Any]:
    """One run in a fresh process (its own peak host memory)."""
    spec = {"overrides": config_overrides(args, model, offload, nvme_dir), "warmup": args.warmup, "steps": args.steps}
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)], env=env, cwd=ROOT, capture_output=True, text=True
    )
    row: dict[str, Any] = {"model": model, "offload": offload, "wall_s": time.perf_counter() - t0}
    if out.returncode != 0:
        row["error"] = (out.stderr.strip().splitlines() or ["?"])[-1]
        return row
    row.update(json.loads(out.stdout.strip().splitlines()[-1]))
    row["load"] = Path("/proc/loadavg").read_text().split()[:3]
    return row


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def table(rows: list[dict[str, Any]]) -> str:
    """One line per model and offload (the rounds' steps together), nvme beside host. Exposed I/O:
    the step's time beyond the host-memory run's; the jobs' wait is summed over the optimizer
    workers (concurrent waits add up); GB/s: bytes over the time the transfers took, each from
    issue to completion (up to a pool's worth run at once)."""
    lines = [
        "| model | params | offload | step s | read GB/s | write GB/s | GB read+written per step | "
        "exposed I/O s/step | jobs' wait s/step | step nvme/host | peak host GiB | engine | load |",
        "|" + "---|" * 13,
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        host_s = _mean([s for r in rows if (r["model"], r["offload"]) == (model, "host") for s in r.get("step_s", [])])
        for offload in ("host", "nvme"):
            ok = [r for r in rows if (r["model"], r["offload"]) == (model, offload) and "error" not in r]
            if not ok:
                bad = [r for r in rows if (r["model"], r["offload"]) == (model, offload)]
                lines.append(
                    f"| {model} | | {offload} | failed: {bad[0]['error'][:80] if bad else 'not run'} |" + " |" * 9
                )
                continue
            steps = [s for r in ok for s in r["step_s"]]
            step, n = _mean(steps), len(steps)
            cells = " | | | | |"
            if offload == "nvme":
                total = {
                    k: sum(r.get(k, 0) for r in ok)
                    for k in ("read_bytes", "write_bytes", "read_s", "write_s", "wait_s")
                }
                cells = (
                    f" {total['read_bytes'] / max(1e-9, total['read_s']) / GB:.2f} |"
                    f" {total['write_bytes'] / max(1e-9, total['write_s']) / GB:.2f} |"
                    f" {(total['read_bytes'] + total['write_bytes']) / n / GB:.1f} |"
                    f" {step - host_s:.2f} | {total['wait_s'] / n:.2f} |"
                )
            ratio = f"{step / host_s:.2f}" if offload == "nvme" and host_s == host_s else ""
            engine = f"{ok[0].get('engine')}{' O_DIRECT' if ok[0].get('direct') else ''}" if offload == "nvme" else ""
            loads = ", ".join("/".join(r["load"]) for r in ok)
            lines.append(
                f"| {model} | {ok[0]['params'] / 1e6:.0f}M | {offload} | {step:.2f} |{cells} {ratio} | "
                f"{max(r['peak_host_bytes'] for r in ok) / 2**30:.2f} | {engine} | {loads} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="100m", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--nvme-dir", default=None, help="the state files' directory (default: a new one under /tmp)")
    p.add_argument("--engine", default="auto", help="optim.nvme_engine: auto | aio | threads")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="rounds of (host, nvme), interleaved")
    p.add_argument("--json", type=Path, help="append every run here (JSON lines)")
    p.add_argument(
        "--report", type=Path, nargs="+", help="print the table of --json files kept before, running nothing"
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.report:
        print(table([json.loads(x) for path in args.report for x in path.read_text().splitlines() if x.strip()]))
        return 0
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    print("`PYTHONPATH=. python profiling/bench_nvme_tier.py " + " ".join(sys.argv[1:]) + "`")
    rows = []
    with tempfile.TemporaryDirectory(prefix="sysx-nvme-", dir=args.nvme_dir) as nvme_dir:
        for model in args.models.split(","):
            for _ in range(args.rounds):
                for offload in ("host", "nvme"):
                    row = run(args, model, offload, nvme_dir)
                    print(f"  {model} {offload}: {row.get('error') or _mean(row['step_s']):} ({row['wall_s']:.0f} s)")
                    rows.append(row)
                    if args.json:
                        with args.json.open("a") as f:
                            f.write(json.dumps(row) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
