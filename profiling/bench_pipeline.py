"""Every pipeline schedule on the emulated SysX cluster, measured by the real runtime, beside its plan.

The paper's setting (SysX §5.1, Tables 1-2): nodes of 4 V100 32 GB on PCIe Gen3 with a 32-core
EPYC, InfiniBand HDR between nodes (``emulate.gpu=v100 emulate.cpu=epyc7452
emulate.net=pcie3_ib_hdr``); LLaMA-2 shapes of Table 2 at micro-batch size 2 and a global batch of
16 x nodes (Fig. 9): 10B and 19B on 4 ranks (1 node, 8 micro-batches), 30B and 40B on 8 ranks (2
nodes, 16 micro-batches). Each rank count is one launch of its ranks, which run every (model,
sequence length, schedule) cell in turn in one process group: a fresh ``PipelineTrainer`` with
``device=emulated`` per cell (``model=tiny`` with the preset's layer count moves the real tensors,
at ``train.seq_len=16``; the costs are the preset's at the sequence length of the row), ``--steps``
steps of which ``--warmup`` are not measured. Measured iteration: the steps' wall time divided by
the time scale (the slowest rank per step); measured bubble: 1 - modelled GPU-busy time / measured
iteration, averaged over ranks; planned: ``simulate`` of the same schedule with the same
``CostTable``. ``sysx:tuned`` is the autotuner's choice for the cell (``schedule.tune``: the
emulated device's profile, the global batch kept; the row says what it chose), measured beside the
fixed layouts; a line under the table compares it with its prediction and the best fixed layout.
Prints one Markdown table (and writes it with ``--out``)::

    PYTHONPATH=. python profiling/bench_pipeline.py --quick
    PYTHONPATH=. python profiling/bench_pipeline.py --models 10b,30b --seq 2048 --steps 4 --time-scale 0.1
    PYTHONPATH=. python profiling/bench_pipeline.py --out profiling/bench_pipeline.md    # everything
    PYTHONPATH=. python profiling/bench_pipeline.py --models 10b --schedules mobius --best-layouts
    PYTHONPATH=. python profiling/bench_pipeline.py --report a.jsonl b.jsonl               # tables of kept runs

A schedule may name its layout: ``sysx:cfg3@s4d3`` (4 forward stages per rank, d = 3), ``mobius@s6``.
``--best-layouts`` adds Mobius, Megatron and SysX CFG3 each at the layout its plan on the emulated
cluster finds fastest, and compares SysX with the baselines run the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"10b": ("llama2_10b", 4), "19b": ("llama2_19b", 4), "30b": ("llama2_30b", 8), "40b": ("llama2_40b", 8)}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "mobius", "sysx:cfg0", "sysx:cfg1", "sysx:cfg2", "sysx:cfg3", "sysx:tuned")
GPUS_PER_NODE, MICRO_BATCH, BATCH_PER_NODE = 4, 2, 16  # the paper's Fig. 9 setting
PAPER = {"sysx_over_mobius": 1.26, "sysx_over_megatron": 1.51}  # SysX §5.2, averages over its Fig. 9


# ------------------------------------------------------------------------------------------ worker
def _cell_config(model: str, seq: int, n_ranks: int, schedule: str, args: dict[str, Any]) -> tuple[Any, Any]:
    """The job config and pipeline options of one cell."""
    from sysx.config import EmulateSection, EvalSection, LogSection, ModelSection, OptimSection, SysxConfig, TrainSection
    from sysx.runtime import PipelineOptions

    base, layout = split_layout(schedule)
    name, _, cfg = base.partition(":cfg")
    if base == "sysx:tuned":  # tuned by _tuned from this config (CFG3 is only the starting point)
        name, cfg = "sysx", "3"
    nodes = max(1, n_ranks // GPUS_PER_NODE)
    cfg_obj = SysxConfig(
        model=ModelSection(preset="tiny"), device="emulated", precision="bf16", seed=0,
        train=TrainSection(steps=args["steps"], micro_batch_size=1, micro_batches=BATCH_PER_NODE * nodes // MICRO_BATCH,
                           seq_len=16),
        optim=OptimSection(backend="torch", workers=args["optimizer_workers"], grad_clip=0.0, warmup_steps=1),
        eval=EvalSection(every=0), log=LogSection(every=1000, progress=False),
        emulate=EmulateSection(model=model, seq_len=seq, micro_batch_size=MICRO_BATCH, time_scale=args["time_scale"],
                               warmup_steps=args["warmup"]))
    opts = PipelineOptions(schedule=name, cfg=int(cfg) if cfg else 3, optim_backend="torch", timeout_s=600.0,
                           stages_per_rank=layout[0], split=layout[1])
    return cfg_obj, opts


def _tuned(cfg: Any, info: Any) -> tuple[Any, Any, Any, str]:
    """``sysx:tuned``: the autotuner's choice for the cell (rank 0 searches with the emulated device's
    profile, every rank takes the choice), its options and predicted costs, and the choice in words."""
    import dataclasses

    import torch

    from sysx.autotune.apply import tune_job
    from sysx.runtime.options import options_from_config

    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, workers=None))  # the tuner picks them
    tuned = tune_job(cfg, info, torch.device("cpu"))
    opts = dataclasses.replace(options_from_config(tuned.cfg), timeout_s=600.0)
    s, t = tuned.cfg.schedule, tuned.cfg
    choice = (f"stages/rank {s.stages_per_rank} d={s.split} cfg{s.cfg} buffers {s.param_buffers} "
              f"mbs {t.emulate.micro_batch_size}x{t.train.micro_batches} workers {t.optim.workers}")
    return tuned.cfg, opts, tuned.costs, choice


def split_layout(schedule: str) -> tuple[str, tuple[int | None, int | None]]:
    """``sysx:cfg3@s4d3`` -> (``sysx:cfg3``, (4, 3)); ``mobius@s6`` -> (``mobius``, (6, None)); no ``@``:
    the runtime's default layout (None, None)."""
    base, _, layout = schedule.partition("@")
    if not layout:
        return base, (None, None)
    m = re.fullmatch(r"s(\d+)(?:d(\d+))?", layout)
    if m is None:
        raise ValueError(f"bad layout {layout!r} in {schedule!r}: write @s<stages per rank>[d<split>], e.g. sysx:cfg3@s4d3")
    return base, (int(m[1]), int(m[2]) if m[2] else None)


def planned_iteration(model: str, seq: int, n_ranks: int, schedule: str, args: dict[str, Any]) -> float | None:
    """The planned iteration (modelled seconds) of one cell, or None when it does not fit, cannot be
    cut at its layout, or the runtime would fall back to another layout."""
    from sysx.config import ConfigError
    from sysx.emulate.costs import emulated_model, plan_emulation
    from sysx.partition import PartitionError
    from sysx.runtime.options import make_schedule
    from sysx.schedule.ops import ScheduleError

    cfg, opts = _cell_config(model, seq, n_ranks, schedule, args)
    em = emulated_model(cfg)
    try:
        sched = make_schedule(opts, em.config, n_ranks=n_ranks, n_micro=cfg.train.micro_batches, seq_len=em.seq_len)
        it = plan_emulation(cfg, sched, backend="torch").timeline.iteration
    except (ConfigError, PartitionError, ScheduleError, ValueError):
        return None
    spr = split_layout(schedule)[1][0]
    return None if spr is not None and sched.n_stages != spr * n_ranks else it


def best_layout(model: str, seq: int, n_ranks: int, schedule: str, args: dict[str, Any]) -> str:
    """``schedule`` at the layout (forward stages per rank 1-6, SysX split d 1-4) whose plan on the
    emulated cluster is fastest: the simulator picks, the run then measures it."""
    splits = (1, 2, 3, 4) if schedule.startswith("sysx") else (None,)
    cands = [f"{schedule}@s{spr}" + (f"d{d}" if d else "") for spr in range(1, 7) for d in splits]
    planned = [(it, c) for c in cands if (it := planned_iteration(model, seq, n_ranks, c, args)) is not None]
    return min(planned)[1] if planned else schedule


def plan_table(cells: list[dict[str, Any]], n_ranks: int, args: dict[str, Any]) -> list[str]:
    """``--plan-only``: one line per cell with its planned iteration, running nothing."""
    lines = []
    for c in cells:
        it = planned_iteration(c["model"], c["seq"], n_ranks, c["schedule"], args)
        lines.append(f"| {c['model'].replace('llama2_', '').upper()} | {c['seq']} | {n_ranks} | {_label(c['schedule'])} | "
                     + (f"{it:.2f} |" if it is not None else "does not fit |"))
    return lines


def _run_cell(info: Any, dataset: Any, model: str, seq: int, schedule: str, args: dict[str, Any]) -> dict[str, Any]:
    from sysx.config import ConfigError, validate
    from sysx.trainers.pipeline import PipelineTrainer

    cfg, opts = _cell_config(model, seq, info.world_size, schedule, args)
    validate(cfg)
    row: dict[str, Any] = {"model": model, "seq": seq, "ranks": info.world_size, "schedule": schedule}
    costs = None
    try:
        if schedule == "sysx:tuned":
            cfg, opts, costs, row["choice"] = _tuned(cfg, info)
        trainer = PipelineTrainer(cfg, opts, info=info, dataset=dataset, tuned_costs=costs)
    except ConfigError as err:  # every rank plans the same: all refuse together (e.g. GPU memory)
        return {**row, "error": str(err)}
    with trainer:
        results = trainer.run(args["steps"])
        report = trainer.emulation_report()
        row.update(report=report, losses=[r.loss for r in results], nsf=trainer.schedule.n_stages,
                   split=trainer.schedule.split, micro_batches=trainer.schedule.n_micro,
                   prediction=trainer.prediction.section or None)
        if args.get("spans") and report is not None:
            row["spans"] = _gather_spans(trainer)
    return row


def _gather_spans(trainer: Any) -> list[Any]:
    """Every rank's modelled spans of its last step (for --trace)."""
    import torch.distributed as dist

    mine = [(trainer.rank, *s) for s in trainer.pacer.steps[-1].spans]
    parts: list[Any] = [None] * trainer.world
    dist.all_gather_object(parts, mine, group=trainer.group)
    return [s for p in parts for s in p]


def worker(spec_path: str, out_path: str) -> int:
    """One rank: every cell of the spec in turn; rank 0 appends a JSON line per cell to ``out_path``."""
    import torch

    torch.set_num_threads(1)
    from sysx import dist as sdist
    from sysx import stopping

    stopping.install()  # SIGINT/SIGTERM: the trainer in progress closes (no segment or thread left)
    from sysx.data import TokenDataset, default_corpus_path

    spec = json.loads(Path(spec_path).read_text())
    info = sdist.init(timeout_s=600.0)
    dataset = TokenDataset(default_corpus_path())
    try:
        for cell in spec["cells"]:
            t0 = time.perf_counter()
            for attempt in range(1 + spec["args"]["retries"]):  # every rank sees the same report: all retry
                row = _run_cell(info, dataset, cell["model"], cell["seq"], cell["schedule"], spec["args"])
                if not (row.get("report") or {}).get("refused"):
                    break
            row.update(wall_s=time.perf_counter() - t0, attempts=attempt + 1)
            if info.rank == 0:
                with open(out_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"bench: {cell} done in {row['wall_s']:.0f} s", flush=True)
    except stopping.JobStopped as stop:  # the parent stops the ranks; the trainer has closed
        return stop.exit_code
    finally:
        sdist.shutdown()
    return 0


# ------------------------------------------------------------------------------------------ parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cells: list[dict[str, Any]], n_ranks: int, args: dict[str, Any], out_path: Path) -> None:
    """Start ``n_ranks`` worker processes (torchrun's environment) on ``cells``; wait for them."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"cells": cells, "args": args}, f)
        spec = f.name
    port = _free_port()
    procs = []
    try:
        for r in range(n_ranks):
            env = {k: v for k, v in os.environ.items() if k != "SYSX_JOB_ID"}
            env.update(RANK=str(r), WORLD_SIZE=str(n_ranks), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n_ranks),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", spec, str(out_path)], env=env, cwd=ROOT,
                                          stdout=None if r == 0 else subprocess.DEVNULL))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"bench_pipeline: a rank failed (exit codes {codes}); see its output above")
    finally:
        for p in procs:  # a rank stopped by SIGTERM closes its trainer (shared memory, threads); then SIGKILL
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        os.unlink(spec)


def _label(schedule: str, row: dict[str, Any] | None = None) -> str:
    """The schedule's name in the table; a SysX row at the default layout names its split ``d`` (the
    default changed from 2 to 3, and older rows are kept)."""
    base, layout = split_layout(schedule)
    name = {"interleaved_1f1b": "Megatron (interleaved 1F1B)", "mobius": "Mobius", "gpipe": "GPipe", "1f1b": "1F1B",
            "sysx:tuned": "SysX tuned"}.get(base, base.replace("sysx:cfg", "SysX CFG"))
    if layout[0] is None:
        if row and base.startswith("sysx:cfg") and base != "sysx:cfg0" and row.get("split"):
            return f"{name} (d={row['split']})"
        return name
    return f"{name}, best layout: {layout[0]} stages/rank" + (f", d={layout[1]}" if layout[1] else "")


def _family(schedule: str) -> tuple[str, bool]:
    """(schedule without layout, whether the row runs a chosen layout)."""
    base, layout = split_layout(schedule)
    return base, layout[0] is not None


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table: one line per cell, with the SysX CFG3 ratios on its row."""
    lines = ["| model | seq | ranks | schedule | measured s/it | measured bubble | planned s/it | planned bubble | "
             "measured/planned | SysX/Mobius | SysX/Megatron |", "|" + "---|" * 11]
    by_key = {(r["model"], r["seq"], *_family(r["schedule"])): r for r in rows}

    def measured(model: str, seq: int, schedule: str, tuned: bool) -> float | None:
        r = by_key.get((model, seq, schedule, tuned))
        m = r and r.get("report") and r["report"]["measured"]
        return m["iteration_s"] if m else None

    for r in rows:
        again = f" ({r['attempts']} runs)" if r.get("attempts", 1) > 1 else ""  # refused before (a hiccup)
        chosen = f" ({r['choice']})" if r.get("choice") else ""
        head = (f"| {r['model'].replace('llama2_', '').upper()} | {r['seq']} | {r['ranks']} | "
                f"{_label(r['schedule'], r)}{chosen}{again} |")
        if "error" in r:
            need = re.search(r"has ([\d.]+ GiB) but .* needs ([\d.]+ GiB) on rank (\d+)", r["error"])
            why = f"needs {need[2]} on rank {need[3]}, the GPU has {need[1]}" if need else r["error"][:90]
            lines.append(head + f" does not fit | | | | {why} | | |")
            continue
        rep = r["report"]
        plan = rep["plan"]
        m = rep["measured"]
        if m is None:
            cells = f" refused | | {plan['iteration_s']:.2f} | {100 * plan['bubble']:.1f}% | {rep['refused'][:80]} | | |"
        else:
            ratios = ["", ""]
            family, tuned = _family(r["schedule"])
            if family == "sysx:cfg3":  # against the baselines run the same way: default or best layouts
                for i, base in enumerate(("mobius", "interleaved_1f1b")):
                    b = measured(r["model"], r["seq"], base, tuned)
                    ratios[i] = f"**{b / m['iteration_s']:.2f}x**" if b else "-"
            cells = (f" {m['iteration_s']:.2f} | {100 * m['bubble']:.1f}% | {plan['iteration_s']:.2f} | "
                     f"{100 * plan['bubble']:.1f}% | {m['over_plan']:.3f} | {ratios[0]} | {ratios[1]} |")
        lines.append(head + cells)
    return "\n".join(lines)


def averages(rows: list[dict[str, Any]]) -> str:
    """Mean SysX CFG3 speed-up over Mobius and over Megatron, across the rows measured for all three."""
    got = {(r["model"], r["seq"], *_family(r["schedule"])): r["report"]["measured"]["iteration_s"] for r in rows
           if (r.get("report") or {}).get("measured")}
    out = []
    for tuned in (False, True):
        for base, name in (("mobius", "Mobius"), ("interleaved_1f1b", "Megatron")):
            ratios = [got[(m, q, base, tuned)] / t for (m, q, sch, tu), t in got.items()
                      if sch == "sysx:cfg3" and tu == tuned and (m, q, base, tuned) in got]
            if ratios:
                out.append(f"SysX/{name}{' (best layouts)' if tuned else ''} {sum(ratios) / len(ratios):.2f}x on average "
                           f"({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rows)")
    return "; ".join(out)


def tuned_lines(rows: list[dict[str, Any]]) -> str:
    """Per (model, seq) with a ``sysx:tuned`` row: its measured time against its prediction and against
    the fastest fixed layout measured beside it."""
    got = {(r["model"], r["seq"], r["schedule"]): r for r in rows if (r.get("report") or {}).get("measured")}
    out = []
    for (m, q, sch), r in got.items():
        if sch != "sysx:tuned":
            continue
        t = r["report"]["measured"]["iteration_s"]
        plan = r["report"]["plan"]["iteration_s"]
        fixed = [(x["report"]["measured"]["iteration_s"], s) for (mm, qq, s), x in got.items()
                 if (mm, qq) == (m, q) and s != "sysx:tuned"]
        line = f"{m} seq {q}: tuned {t:.2f} s measured vs {plan:.2f} s predicted ({100 * (t / plan - 1):+.1f}%)"
        if fixed:
            best, name = min(fixed)
            line += f"; best fixed layout {_label(name)} {best:.2f} s: tuned/best {t / best:.3f}"
        out.append(line)
    return "\n".join(out)


def _latest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell: a measured row over a refused one, else the later one; first-seen order."""
    keep: dict[tuple[str, int, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["model"], r["seq"], r["schedule"])
        old = keep.get(key)
        if old is None or (r.get("report") or {}).get("measured") or not (old.get("report") or {}).get("measured"):
            keep[key] = r
    return list(keep.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="10b,19b,30b,40b", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--seq", default="2048,4096", help="sequence lengths of the emulated costs")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma list of " + ", ".join(SCHEDULES))
    p.add_argument("--steps", type=int, default=4, help="steps per cell (the first --warmup are not measured)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--time-scale", type=float, default=0.1, help="wall seconds per modelled second")
    p.add_argument("--optimizer-workers", type=int, default=1,
                   help="concurrent CPU Adam steps per rank, sharing its 8 threads (DeepSpeed's single worker: 1)")
    p.add_argument("--retries", type=int, default=1,
                   help="run a cell again when its measurement is refused (a busy machine's hiccup), up to this often")
    p.add_argument("--quick", action="store_true", help="10B at seq 2048, Mobius, Megatron and SysX CFG3, 3 steps")
    p.add_argument("--out", type=Path, help="also write the table (and the command) here")
    p.add_argument("--json", type=Path, help="keep every cell's report here (JSON lines)")
    p.add_argument("--trace", action="store_true", help="keep every rank's modelled spans of the last step in --json")
    p.add_argument("--best-layouts", action="store_true",
                   help="also run each of Mobius, Megatron and SysX CFG3 at its fastest planned layout "
                        "(forward stages per rank, SysX split d), the baselines' and SysX's alike")
    p.add_argument("--plan-only", action="store_true", help="print every cell's planned iteration, running nothing")
    p.add_argument("--report", type=Path, nargs="+",
                   help="print the table of --json files kept before (a cell measured again: its last row), running nothing")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    if args.report:
        rows = _latest([json.loads(line) for path in args.report for line in path.read_text().splitlines() if line.strip()])
        print(f"{table(rows)}\n\n{averages(rows)}\n{tuned_lines(rows)}".rstrip())
        return 0
    if args.quick:
        args.models, args.seq, args.schedules, args.steps = "10b", "2048", "mobius,interleaved_1f1b,sysx:cfg3", 3
    models = [m.strip() for m in args.models.split(",")]
    schedules = [s.strip() for s in args.schedules.split(",")]
    bad = [m for m in models if m not in MODELS] + [s for s in schedules if split_layout(s)[0] not in SCHEDULES]
    if bad:
        p.error(f"unknown {', '.join(bad)}; models: {', '.join(MODELS)}; schedules: {', '.join(SCHEDULES)}")
    shared = {"steps": args.steps, "warmup": args.warmup, "time_scale": args.time_scale,
              "optimizer_workers": args.optimizer_workers, "spans": args.trace, "retries": args.retries}
    out_json = args.json or Path(tempfile.mkstemp(suffix=".jsonl")[1])
    out_json.write_text("")
    t0 = time.perf_counter()
    plans: list[str] = []
    for n_ranks in sorted({MODELS[m][1] for m in models}):
        cells = [{"model": MODELS[m][0], "seq": int(s), "schedule": sch} for m in models if MODELS[m][1] == n_ranks
                 for s in args.seq.split(",") for sch in schedules]
        if args.best_layouts:
            cells += [{"model": MODELS[m][0], "seq": int(s), "schedule": best_layout(MODELS[m][0], int(s), n_ranks, sch, shared)}
                      for m in models if MODELS[m][1] == n_ranks for s in args.seq.split(",")
                      for sch in ("mobius", "interleaved_1f1b", "sysx:cfg3")]
        if args.plan_only:
            plans += plan_table(cells, n_ranks, shared)
            continue
        launch(cells, n_ranks, shared, out_json)
    if args.plan_only:
        print("| model | seq | ranks | schedule | planned s/it |\n|---|---|---|---|---|\n" + "\n".join(plans))
        return 0
    rows = [json.loads(line) for line in out_json.read_text().splitlines() if line.strip()]
    text = f"{table(rows)}\n\n{averages(rows)}\n{tuned_lines(rows)}".rstrip()
    print(text)
    print(f"\n{len(rows)} cells in {time.perf_counter() - t0:.0f} s; paper: SysX {PAPER['sysx_over_mobius']}x Mobius, "
          f"{PAPER['sysx_over_megatron']}x Megatron on average")
    if args.out:
        args.out.write_text(f"`python profiling/bench_pipeline.py {' '.join(sys.argv[1:])}`\n\n{text}\n")
    if not args.json:
        out_json.unlink()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(130)
