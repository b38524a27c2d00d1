"""The autotuner's prediction check on real CPU runs, the whole table in one command (issue 27, point 3).

Runs ``sysx.train`` on this machine for each configuration of the table (the tiny model and a
~50M one, 2 and 4 ranks with ``schedule=auto schedule.tune=true``, and ``schedule=single``), reads
each run's ``summary.json`` ``prediction`` section and prints predicted vs measured seconds per
iteration and peak host memory with their errors, and the load average before and after each run.
The single rows compute with torch's threads (every core), as ``sysx-train`` does; the ranks
with their own (:func:`sysx.optim.cores.apply_plan`). Every run measures its own profile (a
fresh cache directory per invocation, shared by its runs, so the 4-rank run reuses the 2-rank
run's profile of the same model, as a user's second job would).

    PYTHONPATH=. python profiling/check_predictions.py [--only tiny:2,single:tiny] [--jsonl OUT]

Prints a Markdown table (pasteable into ``profiling/RESULTS.md``) and, with ``--jsonl``, appends
one JSON line per run. Peak host is measured as each run measures it (:mod:`sysx.trainers.prediction`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS = {
    "tiny": ["model=tiny"],
    "50M": [
        "model=tiny",
        "model.dim=512",
        "model.n_layers=16",
        "model.n_heads=8",
        "model.n_kv_heads=8",
        "model.ffn_dim=1376",
    ],
}
COMMON = [
    "eval.every=0",
    "log.progress=false",
    "optim.backend=torch",
    "checkpoint.keep=1",
    "train.seq_len=128",
]
# steps a run takes: the check measures the steps after the first until they span 2 s
# (sysx.autotune.check.WINDOW_S; 3 tiny steps scattered by +-7% between identical runs): tiny steps
# (0.13-0.2 s) need 11-16 of them; the 50M rows' first 3 steps span 15 s
STEPS = {"tiny": 20, "50M": 5}
PIPELINE = ["schedule=auto", "schedule.tune=true", "train.micro_batch_size=2", "train.micro_batches=8"]
# (name, model, ranks): ranks 1 is schedule=single, one process
TABLE = [
    ("tiny:2", "tiny", 2),
    ("tiny:4", "tiny", 4),
    ("50M:2", "50M", 2),
    ("50M:4", "50M", 4),
    ("single:tiny", "tiny", 1),
    ("single:50M", "50M", 1),
]
HOST = "peak_host_bytes"


def load() -> float:
    """The 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def command(model: str, ranks: int, run_dir: Path, device: str = "cpu", extra: tuple[str, ...] = ()) -> list[str]:
    """The ``sysx.train`` command line of one configuration (``extra``: more overrides, last)."""
    args = [*MODELS[model], *COMMON, f"device={device}", f"train.steps={STEPS[model]}", f"run_dir={run_dir}", *extra]
    if ranks == 1:
        return [sys.executable, "-m", "sysx.train", "schedule=single", *args]
    launch = [sys.executable, "-m", "sysx.launch", "--standalone", f"--nproc_per_node={ranks}"]
    return [*launch, "-m", "sysx.train", *PIPELINE, *args]


def run_one(
    name: str,
    model: str,
    ranks: int,
    root: Path,
    timeout_s: float,
    cache: Path,
    device: str = "cpu",
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run one configuration; its prediction section, timings and the load around it."""
    run_dir = root / name.replace(":", "_")
    cmd = command(model, ranks, run_dir, device, extra)
    env = {**os.environ, "SYSX_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    if ranks == 1:  # one process computes with torch's threads, as `sysx-train` does (ranks set their own)
        del env["OMP_NUM_THREADS"]
    row: dict[str, Any] = {"name": name, "model": model, "ranks": ranks, "command": shlex.join(cmd[1:])}
    row["load_before"] = load()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    row["wall_s"] = time.perf_counter() - t0
    row["load_after"] = load()
    row["rc"] = proc.returncode
    if run_dir.is_dir():  # the plan, the tune lines and the steps, beside the run's files (--keep)
        (run_dir / "output.txt").write_text(proc.stdout + proc.stderr)
    summary = run_dir / "summary.json"
    if proc.returncode != 0 or not summary.exists():
        row["error"] = (proc.stderr or proc.stdout)[-2000:]
        return row
    data = json.loads(summary.read_text())
    row["prediction"] = data.get("prediction", {})
    # the tune lines: how the profile was had, the p2p links and the layers' measured slowdown; the winner
    lines = proc.stdout.splitlines()
    row["choice"] = [ln for ln in lines if ln.startswith("schedule.tune (")][-1:]
    row["choice"] += [ln.strip() for ln in lines if ln.lstrip().startswith("winner `")][-1:]
    # with --set 'profile.timeline_steps=[A,B]': how far apart the replicas finished their passes
    row["replicas"] = [ln for ln in lines if ln.startswith("replicas: ")][-1:]
    return row


def _cells(entry: dict[str, float] | None, scale: float, fmt: str) -> list[str]:
    if not entry:
        return ["-", "-", "-"]
    return [
        fmt.format(entry["predicted"] / scale),
        fmt.format(entry["measured"] / scale),
        f"{entry['error_pct']:+.1f}%",
    ]


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of ``rows``."""
    head = (
        "| run | predicted s/it | measured s/it | error | predicted host | measured host | error "
        "| load before -> after | wall s |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        pred = r.get("prediction") or {}
        cells = [r["name"], *_cells(pred.get("iteration_s"), 1.0, "{:.3f}")]
        cells += [c if i == 2 else f"{c} MiB" for i, c in enumerate(_cells(pred.get(HOST), 2**20, "{:.1f}"))]
        cells += [f"{r['load_before']:.1f} -> {r['load_after']:.1f}", f"{r['wall_s']:.0f}"]
        if "error" in r:
            cells[1] = f"failed (rc {r['rc']})"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only", default="", help="comma-separated run names (default: all): " + ",".join(n for n, *_ in TABLE)
    )
    ap.add_argument("--jsonl", type=Path, help="append one JSON line per run here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    ap.add_argument("--keep", type=Path, help="run and cache directory to keep (default: a temporary one)")
    ap.add_argument(
        "--cache",
        type=Path,
        help="profile cache to use and keep (default: a fresh one under the run directory): a second round "
        "with the first's cache reuses its profiles, so both run the same layouts",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="the runs' device (default cpu: the check is about CPU runs, also on a machine with a GPU, where "
        "device=auto would put every rank on it; cuda only for the single rows, one process on the GPU)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more override for every run, e.g. --set 'profile.timeline_steps=[8,10]' (the timeline and "
        "its measured-vs-plan line in each kept run directory, with --keep)",
    )
    args = ap.parse_args(argv)
    wanted = set(filter(None, args.only.split(",")))
    unknown = wanted - {n for n, *_ in TABLE}
    if unknown:
        ap.error(f"--only: unknown run {sorted(unknown)}; choose from {[n for n, *_ in TABLE]}")
    if args.device == "cuda" and any(ranks > 1 for name, _, ranks in TABLE if not wanted or name in wanted):
        ap.error("--device cuda: one GPU per rank, so only the single rows (--only single:tiny,single:50M)")
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="check_predictions-") as tmp:
        root = args.keep or Path(tmp)
        for name, model, ranks in TABLE:
            if wanted and name not in wanted:
                continue
            row = run_one(
                name, model, ranks, root, args.timeout, args.cache or root / "cache", args.device, tuple(args.set)
            )
            rows.append(row)
            status = row.get("error", "")[-300:] or json.dumps(row.get("prediction", {}))
            print(
                f"{name}: {row['wall_s']:.0f} s, load {row['load_before']:.1f} -> {row['load_after']:.1f}: {status}",
                *(f"\n  {line}" for line in row.get("replicas", [])),
                flush=True,
            )
            if args.jsonl:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}) + "\n")
    print(table(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
