"""``sysx bench optim [--size 50M] [--json]``: one CpuAdam step under each rollback mode.

Times, on one buffer of ``--size`` fp32 parameters and ``--threads`` intra-op threads (1 by
default), the median over ``--repeat`` rounds after ``--warmup`` rounds of: a plain in-place
DeepSpeed step (``step_ms``); ``rollback=exact``'s step, DeepSpeed's in-place step on the refreshed
spare set (``exact_step_ms``: its critical path, from gradients ready to the new state ready) and,
separately, the refresh of that spare after the decision (``exact_refresh_ms``: a copy of p, m, v
that runs off the critical path, during the next forward); the step of ``rollback=snapshot`` (copy,
then step: ``snapshot_step_ms``) and the arithmetic ``undo`` of one step (``undo_ms``). The modes
take turns within each round, so a change of machine load moves all of them alike. Prints a
Markdown table with ratios to the plain step, or with ``--json`` one JSON line, both with the
machine (CPU model, AVX2/AVX-512, cores, load average).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sysx.optim.cores import intra_op_threads
from sysx.optim.cpu_adam import CpuAdam


def parse_size(text: str) -> int:
    """``50M``, ``1.5G``, ``200K`` or a plain count -> elements."""
    t = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--size {text!r} is not valid: give a positive element count such as 50M, 200K or 1000")
    return n


def machine() -> dict[str, Any]:
    """CPU model, AVX2 / AVX-512 flags, cores and the 1-minute load average."""
    model, flags = "unknown", set[str]()
    with contextlib.suppress(OSError):  # no /proc/cpuinfo (not Linux): the model stays unknown
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return {
        "cpu": model,
        "avx2": "avx2" in flags,
        "avx512": "avx512f" in flags,
        "cores": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "torch_simd": str(torch.backends.cpu.get_cpu_capability()),
    }


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _refreshed(opt: CpuAdam) -> None:
    if not opt.refresh():
        raise RuntimeError("sysx bench optim: the exact mode's spare was not refreshed (it was not stale)")


def run(numel: int, *, repeat: int = 7, warmup: int = 2, threads: int = 1) -> dict[str, Any]:
    """The five medians (ms) and the machine; every optimizer starts from the same values."""
    with intra_op_threads(threads):
        times, exact_backend = _time_modes(numel, repeat, warmup)
    out: dict[str, Any] = {"size": numel, "threads": threads, "repeat": repeat}
    out.update({key: round(statistics.median(v), 2) for key, v in times.items()})
    out["exact_ratio"] = round(out["exact_step_ms"] / out["step_ms"], 3)
    # the same ratio taken within each round (the two steps ran back to back), then the median: the
    # steadier figure when other processes load the machine
    out["exact_ratio_paired"] = round(
        statistics.median(e / p for e, p in zip(times["exact_step_ms"], times["step_ms"])), 3
    )
    out["exact_backend"] = exact_backend
    out["machine"] = machine()
    return out


def _time_modes(numel: int, repeat: int, warmup: int) -> tuple[dict[str, list[float]], str]:
    """Each mode's times (ms) over ``repeat`` rounds after ``warmup``, on this thread's threads, and
    the backend the exact mode ran."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(numel, generator=gen) * 0.02
    g = torch.randn(numel, generator=gen) * 1e-2
    kw: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, backend="deepspeed")
    plain = CpuAdam(p0.clone(), rollback="undo", **kw)
    exact = CpuAdam(p0.clone(), rollback="exact", **kw)
    snap = CpuAdam(p0.clone(), rollback="snapshot", **kw)
    del p0
    times: dict[str, list[float]] = {
        "step_ms": [],
        "exact_step_ms": [],
        "exact_refresh_ms": [],
        "snapshot_step_ms": [],
        "undo_ms": [],
    }
    try:

        def plain_round(row: dict[str, float]) -> None:
            row["step_ms"] = _timed(lambda: plain.step(g))
            row["undo_ms"] = _timed(lambda: plain.undo(g))

        def exact_round(row: dict[str, float]) -> None:
            row["exact_step_ms"] = _timed(lambda: exact.step(g))  # the spare was refreshed last round
            exact.undo()
            row["exact_refresh_ms"] = _timed(lambda: _refreshed(exact))

        def snapshot_round(row: dict[str, float]) -> None:
            row["snapshot_step_ms"] = _timed(lambda: snap.step(g))
            snap.undo()

        order = [plain_round, exact_round, snapshot_round]
        for i in range(warmup + repeat):
            # each step is rolled back so every round steps the same state (undo's own time is a
            # row); the order rotates so no mode always runs after the same one
            row: dict[str, float] = {}
            for fn in order[i % 3 :] + order[: i % 3]:
                fn(row)
            if i >= warmup:
                for key, ms in row.items():
                    times[key].append(ms)
    finally:
        for opt in (plain, exact, snap):
            opt.close()
    return times, exact.backend


def table(r: dict[str, Any]) -> str:
    """The Markdown table of :func:`run`'s result."""
    m = r["machine"]
    plain = r["step_ms"]
    mib = 12 * r["size"] / 2**20
    rows = [
        ("plain in-place step (DeepSpeed)", plain, "0"),
        ("exact: DeepSpeed's in-place step on the spare set (critical path)", r["exact_step_ms"], f"{mib:.0f} MiB"),
        (
            "exact: refresh of the spare, copy of p, m, v (off the critical path: next forward)",
            r["exact_refresh_ms"],
            "-",
        ),
        ("snapshot: copy p, m, v, then step", r["snapshot_step_ms"], f"{mib:.0f} MiB"),
        ("undo: arithmetic inverse of one step", r["undo_ms"], "0"),
    ]
    lines = [
        f"{r['size'] / 1e6:g}M fp32 parameters, {r['threads']} thread(s), median of {r['repeat']}; {m['cpu']}, "
        f"AVX2 {'yes' if m['avx2'] else 'no'}, AVX-512 {'yes' if m['avx512'] else 'no'}, {m['cores']} cores, "
        f"load {m['load_avg_1m']}",
        "",
        "| mode | ms | x plain | extra memory |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {ms:.1f} | {ms / plain:.2f} | {extra} |" for name, ms, extra in rows]
    lines += ["", f"exact / plain within each round, median: {r['exact_ratio_paired']:.2f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse, run, print."""
    ap = argparse.ArgumentParser(prog="sysx bench optim", description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="50M", help="fp32 parameters in the buffer (default 50M)")
    ap.add_argument("--repeat", type=int, default=7, help="timed rounds; medians are reported (default 7)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = ap.parse_args(argv)
    try:
        numel = parse_size(args.size)
    except ValueError as exc:
        print(f"sysx bench optim: {exc}", file=sys.stderr)
        return 2
    for name in ("repeat", "threads"):
        if getattr(args, name) < 1:
            print(
                f"sysx bench optim: --{name} {getattr(args, name)} is not valid: give an integer >= 1", file=sys.stderr
            )
            return 2
    result = run(numel, repeat=args.repeat, warmup=max(0, args.warmup), threads=args.threads)
    print(json.dumps(result) if args.json else table(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
