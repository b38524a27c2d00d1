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

A SysX CFG3 schedule may end in ``~plain`` (``schedule.spread_last_step=false``: the last optimizer
step on its owner alone) or ``~spread`` (``true``); unsuffixed, the default spreads it over the
owner's emulated node. A schedule may name its layout: ``sysx:cfg3@s4d3`` (4 forward stages per rank, d = 3), ``mobius@s6``;
a SysX one its ``optim.placement`` (default ``auto``): ``sysx:cfg3+split``, ``sysx:cfg3@s4d3+cpu``
(``--placements cpu,split`` adds such SysX CFG3 rows). A row at a placement says how many
sub-stages the placement model put on the device lane (the JSON row keeps each rank's split and
predicted saving); beside its ``+cpu`` sibling it gets the speed-up over it, with the measured
saving, the plan's and the placement model's. The planned column simulates the device lane
(:func:`sysx.emulate.costs.device_lane_plan`) where a rank put sub-stages on it, and then shows
the CPU lane's plan alone beside it. ``--gpu h100`` (or ``a100``) emulates every cell on that GPU
instead of the paper's V100::

    PYTHONPATH=. python profiling/bench_pipeline.py --models 10b --seq 2048 --gpu h100 \
        --schedules mobius,sysx:cfg3+cpu,sysx:cfg3+split --steps 4
``--best-layouts`` adds Mobius, Megatron and SysX CFG3 each at the layout its plan on the emulated
cluster finds fastest, and compares SysX with the baselines run the same way.

``--replicas 2`` adds replica rows (``parallel.replicas``): every schedule as R replicas of the
model's pipeline (R x its ranks, each replica with the Fig. 9 batch of its nodes), beside the same
schedule as one pipeline over all R x ranks at the same global batch; a line under the table gives
their tokens per modelled second against both one-pipeline rows (the long pipeline, and the
model's pipeline alone, R=1). The 10B table of the replicas (``--plan-only`` plans it)::

    PYTHONPATH=. python profiling/bench_pipeline.py --models 10b --seq 2048 --schedules sysx:cfg3 --replicas 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"10b": ("llama2_10b", 4), "19b": ("llama2_19b", 4), "30b": ("llama2_30b", 8), "40b": ("llama2_40b", 8)}
SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "mobius",
    "sysx:cfg0",
    "sysx:cfg1",
    "sysx:cfg2",
    "sysx:cfg3",
    "sysx:tuned",
)
GPUS_PER_NODE, MICRO_BATCH, BATCH_PER_NODE = 4, 2, 16  # the paper's Fig. 9 setting
PAPER = {"sysx_over_mobius": 1.26, "sysx_over_megatron": 1.51}  # SysX §5.2, averages over its Fig. 9
GPUS = {"v100": "v100", "a100": "a100_80g", "h100": "h100"}  # --gpu -> emulate.gpu (v100: the paper's cluster)
SPREAD = {"~spread": True, "~plain": False}  # a SysX CFG3 schedule's suffix: schedule.spread_last_step
PLACEMENTS = ("auto", "cpu", "split")  # a SysX schedule's ``+<optim.placement>`` suffix (sysx.config.choices)


# ------------------------------------------------------------------------------------------ worker
def _cell_config(
    model: str,
    seq: int,
    n_ranks: int,
    schedule: str,
    args: dict[str, Any],
    replicas: int = 1,
    overrides: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """The job config and pipeline options of one cell of ``n_ranks`` processes, ``replicas`` pipelines
    of ``n_ranks / replicas`` ranks (each replica the Fig. 9 batch of its own nodes); ``overrides``:
    ``{"section.key": value}`` set last (e.g. ``optim.offload``, ``train.micro_batches``)."""
    from sysx.config import (
        EmulateSection,
        EvalSection,
        LogSection,
        ModelSection,
        OptimSection,
        SysxConfig,
        TrainSection,
    )
    from sysx.config.sections import ParallelSection
    from sysx.runtime import PipelineOptions

    schedule, spread = split_spread(schedule)
    base, layout = split_layout(schedule)
    placement = split_placement(schedule)[1] or "auto"
    name, _, cfg = base.partition(":cfg")
    if base == "sysx:tuned":  # tuned by _tuned from this config (CFG3 is only the starting point)
        name, cfg = "sysx", "3"
    nodes = max(1, n_ranks // replicas // GPUS_PER_NODE)  # of one replica
    cfg_obj = SysxConfig(
        model=ModelSection(preset="tiny"),
        device="emulated",
        precision="bf16",
        seed=0,
        train=TrainSection(
            # the real rows as many as the emulated ones: SysX's backward parts split them (schedule.backward_parts)
            steps=args["steps"],
            micro_batch_size=MICRO_BATCH,
            micro_batches=BATCH_PER_NODE * nodes // MICRO_BATCH,
            seq_len=16,
        ),
        optim=OptimSection(
            backend="torch", workers=args["optimizer_workers"], grad_clip=0.0, warmup_steps=1, placement=placement
        ),
        eval=EvalSection(every=0),
        log=LogSection(every=1000, progress=False),
        parallel=ParallelSection(replicas=replicas if replicas > 1 else None),
        emulate=EmulateSection(
            gpu=GPUS[args.get("gpu", "v100")],
            model=model,
            seq_len=seq,
            micro_batch_size=MICRO_BATCH,
            time_scale=args["time_scale"],
            warmup_steps=args["warmup"],
        ),
    )
    opts = PipelineOptions(
        schedule=name,
        cfg=int(cfg) if cfg else 3,
        optim_backend="torch",
        timeout_s=600.0,
        stages_per_rank=layout[0] or None,  # BLOCKS: the default rule's
        split=layout[1],
        spread_last_step=spread,
    )
    return with_overrides(cfg_obj, overrides or {}), opts


def with_overrides(cfg: Any, overrides: dict[str, Any]) -> Any:
    """``cfg`` with every ``{"section.key": value}`` of ``overrides`` set."""
    import dataclasses

    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: value})})
    return cfg


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
    choice = (
        f"stages/rank {s.stages_per_rank} d={s.split} cfg{s.cfg} buffers {s.param_buffers} "
        f"mbs {t.emulate.micro_batch_size}x{t.train.micro_batches} workers {t.optim.workers}"
    )
    return tuned.cfg, opts, tuned.costs, choice


def split_spread(schedule: str) -> tuple[str, bool | None]:
    """``sysx:cfg3@s4d3~plain`` -> (``sysx:cfg3@s4d3``, False): a SysX CFG3 cell's
    ``schedule.spread_last_step`` (``~spread``: true, ``~plain``: false; no suffix: null, the default,
    which spreads the last optimizer step over the owner's emulated node)."""
    for suffix, value in SPREAD.items():
        if schedule.endswith(suffix):
            rest = schedule[: -len(suffix)]
            if not rest.startswith("sysx:cfg3"):
                raise ValueError(f"bad {suffix!r} in {schedule!r}: only SysX CFG3 spreads its last step")
            return rest, value
    return schedule, None


def split_placement(schedule: str) -> tuple[str, str | None]:
    """``sysx:cfg3+split@s4d3`` (or ``sysx:cfg3@s4d3+split``) -> (``sysx:cfg3@s4d3``, ``split``): the
    ``optim.placement`` a SysX cell runs at; no ``+``: None (the default, ``auto``). A ``~spread``
    suffix is left out."""
    schedule = split_spread(schedule)[0]
    m = re.search(r"\+([^@+]*)", schedule)
    if m is None:
        return schedule, None
    rest = schedule[: m.start()] + schedule[m.end() :]
    if m[1] not in PLACEMENTS or not rest.startswith("sysx:") or "+" in rest:
        raise ValueError(
            f"bad placement {m[0]!r} in {schedule!r}: write a SysX schedule +<{'|'.join(PLACEMENTS)}>, "
            "e.g. sysx:cfg3+split or sysx:cfg3@s4d3+cpu"
        )
    return rest, m[1]


BLOCKS = 0  # ``@blocks``: stages per rank of SysX's one-block-per-stage default, chosen as a best layout


def split_layout(schedule: str) -> tuple[str, tuple[int | None, int | None]]:
    """``sysx:cfg3@s4d3`` -> (``sysx:cfg3``, (4, 3)); ``mobius@s6`` -> (``mobius``, (6, None)); no ``@``:
    the runtime's default layout (None, None). A placement suffix (``+split``) is left out."""
    base, _, layout = split_placement(schedule)[0].partition("@")  # and without ~spread
    if not layout:
        return base, (None, None)
    if layout == "blocks":  # SysX's default rule chosen as a best layout: no whole stages per rank
        return base, (BLOCKS, None)
    m = re.fullmatch(r"s(\d+)(?:d(\d+))?", layout)
    if m is None:
        raise ValueError(
            f"bad layout {layout!r} in {schedule!r}: write @s<stages per rank>[d<split>], e.g. sysx:cfg3@s4d3, or sysx:cfg3@blocks"
        )
    return base, (int(m[1]), int(m[2]) if m[2] else None)


def planned_iteration(
    model: str, seq: int, n_ranks: int, schedule: str, args: dict[str, Any], replicas: int = 1
) -> float | None:
    """The planned iteration (modelled seconds) of one cell (``replicas`` pipelines of ``n_ranks /
    replicas`` ranks), or None when it does not fit, cannot be cut at its layout, or the runtime
    would fall back to another layout."""
    from sysx.config import ConfigError
    from sysx.emulate.costs import emulated_model, plan_emulation
    from sysx.partition import PartitionError
    from sysx.runtime.options import make_schedule
    from sysx.schedule.ops import ScheduleError

    cfg, opts = _cell_config(model, seq, n_ranks, schedule, args, replicas)
    em = emulated_model(cfg)
    pipeline = n_ranks // replicas
    try:
        sched = make_schedule(
            opts,
            em.config,
            n_ranks=pipeline,
            n_micro=cfg.train.micro_batches,
            seq_len=em.seq_len,
            ranks_per_node=GPUS_PER_NODE,
            spread_allowed=replicas == 1,
            micro_batch_size=cfg.train.micro_batch_size,
        )
        it = _lane_planned(cfg, sched, plan_emulation(cfg, sched, backend="torch", replicas=replicas))
    except (ConfigError, PartitionError, ScheduleError, ValueError):
        return None
    spr = split_layout(split_spread(schedule)[0])[1][0]
    return None if spr and sched.n_stages != spr * pipeline else it


def _lane_planned(cfg: Any, sched: Any, plan: Any) -> float:
    """The planned iteration with every rank's ``optim.placement`` split on the device lane, as the
    trainer computes it (:func:`sysx.emulate.costs.device_lane_plan`)."""
    from sysx.emulate.costs import device_lane_plan
    from sysx.runtime.lanes import emulated_placement, lane_times

    ranks = [
        emulated_placement(cfg.optim.placement, plan, sched, r, speculative=cfg.optim.speculate != "never")
        for r in range(sched.n_ranks)
    ]
    if not any(p.device for p, _ in ranks):
        return float(plan.timeline.iteration)
    return device_lane_plan(plan, sched, lane_times(sched, ranks))[0]


def best_layout(model: str, seq: int, n_ranks: int, schedule: str, args: dict[str, Any]) -> str:
    """``schedule`` at the layout (forward stages per rank 1-12, SysX split d 1-4, and SysX's default,
    a block per stage: ``@blocks``) whose plan on the emulated cluster is fastest: the simulator picks,
    the run then measures it (12 per rank is the finest whole layout of 30B and 40B on 8 ranks)."""
    splits = (1, 2, 3, 4) if schedule.startswith("sysx") else (None,)
    cands = [f"{schedule}@s{spr}" + (f"d{d}" if d else "") for spr in range(1, 13) for d in splits]
    if schedule.startswith("sysx"):
        cands.insert(0, f"{schedule}@blocks")
    planned = [(it, c) for c in cands if (it := planned_iteration(model, seq, n_ranks, c, args)) is not None]
    return min(planned)[1] if planned else schedule


def plan_table(cells: list[dict[str, Any]], n_ranks: int, args: dict[str, Any]) -> list[str]:
    """``--plan-only``: one line per cell with its planned iteration, running nothing."""
    lines = []
    for c in cells:
        r = c.get("replicas", 1)
        it = planned_iteration(c["model"], c["seq"], n_ranks, c["schedule"], args, r)
        tokens = f" {r * _tokens(c['model'], c['seq'], n_ranks // r) / it:.0f} |" if it else " |"
        lines.append(
            f"| {c['model'].replace('llama2_', '').upper()} | {c['seq']} | {_ranks(n_ranks, r)} | "
            f"{_label(c['schedule'])} | " + (f"{it:.2f} |" if it is not None else "does not fit |") + tokens
        )
    return lines


def _ranks(n_ranks: int, replicas: int) -> str:
    """The ranks column: ``8``, or ``2x4`` for two replicas of a 4-rank pipeline."""
    return f"{replicas}x{n_ranks // replicas}" if replicas > 1 else str(n_ranks)


def _tokens(model: str, seq: int, pipeline: int) -> int:
    """Tokens per step of one replica of a ``pipeline``-rank pipeline (the Fig. 9 batch of its nodes)."""
    return BATCH_PER_NODE * max(1, pipeline // GPUS_PER_NODE) * seq


def _run_cell(
    info: Any,
    dataset: Any,
    model: str,
    seq: int,
    schedule: str,
    args: dict[str, Any],
    replicas: int = 1,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from sysx.config import ConfigError, validate
    from sysx.trainers.pipeline import PipelineTrainer

    cfg, opts = _cell_config(model, seq, info.world_size, schedule, args, replicas, overrides)
    validate(cfg)
    row: dict[str, Any] = {
        "model": model,
        "seq": seq,
        "ranks": info.world_size,
        "schedule": schedule,
        "gpu": args.get("gpu", "v100"),
        **({"replicas": replicas} if replicas > 1 else {}),
        **({"set": overrides} if overrides else {}),
    }
    costs = None
    try:
        if split_placement(schedule)[0] == "sysx:tuned":
            cfg, opts, costs, row["choice"] = _tuned(cfg, info)
        trainer = PipelineTrainer(cfg, opts, info=info, dataset=dataset, tuned_costs=costs)
    except ConfigError as err:  # every rank plans the same: all refuse together (e.g. GPU memory)
        return {**row, "error": str(err)}
    with trainer:
        results = trainer.run(args["steps"])
        report = trainer.device_model.sections()["emulation"]
        row.update(
            report=report,
            losses=[r.loss for r in results],
            nsf=trainer.schedule.n_stages,
            split=trainer.schedule.split,
            micro_batches=trainer.schedule.n_micro,
            prediction=trainer.prediction.section or None,
            placement=trainer.placement_ranks or {"mode": cfg.optim.placement},
        )  # each rank's split, its saving
        if args.get("spans") and report is not None:
            row["spans"] = _gather_spans(trainer)
        tier = getattr(trainer.runtime.optimizer, "tier", None)
        if tier is not None:  # optim.offload=nvme: rank 0's tier over the whole run
            row["tier"] = {**vars(tier.stats), "stages": len(tier.stages)}
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
            attempts = 0
            for _ in range(1 + spec["args"]["retries"]):  # every rank sees the same report: all retry
                attempts += 1
                row = _run_cell(
                    info,
                    dataset,
                    cell["model"],
                    cell["seq"],
                    cell["schedule"],
                    spec["args"],
                    cell.get("replicas", 1),
                    cell.get("set"),
                )
                if not (row.get("report") or {}).get("refused"):
                    break
            row.update(wall_s=time.perf_counter() - t0, attempts=attempts)
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
def launch(cells: list[dict[str, Any]], n_ranks: int, args: dict[str, Any], out_path: Path) -> None:
    """Start ``n_ranks`` worker processes (torchrun's environment) on ``cells``; wait for them."""
    from sysx.dist import free_port

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"cells": cells, "args": args}, f)
        spec = f.name
    port = free_port()
    procs = []
    try:
        for r in range(n_ranks):
            env = {k: v for k, v in os.environ.items() if k != "SYSX_JOB_ID"}
            env.update(
                RANK=str(r),
                WORLD_SIZE=str(n_ranks),
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE=str(n_ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", spec, str(out_path)],
                    env=env,
                    cwd=ROOT,
                    stdout=None if r == 0 else subprocess.DEVNULL,
                )
            )
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
    default changed from 2 to 3, and older rows are kept) and its forward stages per rank when they
    are not 2 (the default of CFG2-3 became 4 where the model has the layers, then one block per
    stage, which no whole number of stages per rank spells), a row at a placement
    names it and how many sub-stages went to the device."""
    base, layout = split_layout(schedule)
    name = {
        "interleaved_1f1b": "Megatron (interleaved 1F1B)",
        "mobius": "Mobius",
        "gpipe": "GPipe",
        "1f1b": "1F1B",
        "sysx:tuned": "SysX tuned",
    }.get(base, base.replace("sysx:cfg", "SysX CFG"))
    if layout[0] is None:
        if row and base.startswith("sysx:cfg") and base != "sysx:cfg0" and row.get("split"):
            pipeline = row.get("ranks", 0) // row.get("replicas", 1)
            per_rank = row.get("nsf", 0) // pipeline if pipeline else 2
            stages = f"{per_rank} stages/rank, " if per_rank not in (0, 2) else ""
            if pipeline and row.get("nsf", 0) % pipeline:  # the default of CFG2-3 since issue 27's twelfth session
                stages = "a block per stage, "
            name = f"{name} ({stages}d={row['split']})"
    else:
        per_rank = "a block per stage, d=1" if layout[0] == BLOCKS else f"{layout[0]} stages/rank"
        name = f"{name}, best layout: {per_rank}" + (f", d={layout[1]}" if layout[1] else "")
    spread = {True: ", last optimizer step spread over the node", False: ", last optimizer step on its owner"}.get(
        split_spread(schedule)[1], ""
    )
    return name + spread + _placement_label(split_placement(schedule)[1], row)


def _placement_label(placement: str | None, row: dict[str, Any] | None) -> str:
    """``, optim.placement=split: 17 of 24 sub-stages on the device`` (all ranks); the default
    (``auto``) only when it moved any."""
    ranks = ((row or {}).get("placement") or {}).get("ranks") or []
    on, total = sum(len(r["device"]) for r in ranks), sum(r["units"] for r in ranks)
    moved = f": {on} of {total} sub-stages on the device" if ranks else ""
    if placement in (None, "auto"):
        return f", optim.placement=auto{moved}" if on else ""
    return f", optim.placement={placement}" + ("" if placement == "cpu" else moved)


def _placement(schedule: str) -> str | None:
    """The row's placement, None for the default (``auto``, named or not)."""
    placement = split_placement(schedule)[1]
    return None if placement == "auto" else placement


def _family(schedule: str) -> tuple[str, bool]:
    """(schedule without layout, ``~spread`` kept; whether the row runs a chosen layout)."""
    base, layout = split_layout(schedule)
    spread = split_spread(schedule)[1]
    return base + "".join(k for k, v in SPREAD.items() if v is spread), layout[0] is not None


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    """A row's place among its siblings: (GPU, model, seq, schedule without layout, chosen layout?,
    placement, ranks, replicas)."""
    return (
        r.get("gpu", "v100"),
        r["model"],
        r["seq"],
        *_family(r["schedule"]),
        _placement(r["schedule"]),
        r.get("ranks"),
        r.get("replicas", 1),
    )


def _iteration(r: dict[str, Any] | None) -> float | None:
    m = r and r.get("report") and r["report"]["measured"]
    return m["iteration_s"] if m else None


def _cpu_sibling(r: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``+cpu`` row of the same GPU, model, seq and layout as ``r`` (a split or default row)."""
    if _placement(r["schedule"]) == "cpu" or not r["schedule"].startswith("sysx:"):
        return None
    same = split_placement(r["schedule"])[0]
    return next(
        (
            x
            for x in rows
            if x.get("gpu", "v100") == r.get("gpu", "v100")
            and (x["model"], x["seq"]) == (r["model"], r["seq"])
            and split_placement(x["schedule"]) == (same, "cpu")
        ),
        None,
    )


def _model_saving(r: dict[str, Any]) -> float | None:
    """The placement model's predicted saving of the step: when the slowest rank's optimizer work
    ends with the CPU lane alone less when it ends with the split (None: no split recorded)."""
    ranks = (r.get("placement") or {}).get("ranks")
    if not ranks:
        return None
    return max(x["cpu_finish_s"] for x in ranks) - max(x["finish_s"] for x in ranks)


def vs_cpu(r: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """A placement's speed-up over its ``+cpu`` sibling, measured, with the measured saving, the
    plan's (device lane simulated) and the placement model's own: ``**1.58x** (-1.22 s; plan -1.23 s,
    model -1.35 s)``; empty without a measured sibling."""
    cpu = _cpu_sibling(r, rows)
    it, base = _iteration(r), _iteration(cpu)
    if cpu is None or it is None or base is None:
        return ""
    plan = r["report"]["plan"]["iteration_s"] - cpu["report"]["plan"]["iteration_s"]
    model = _model_saving(r)
    return f"**{base / it:.2f}x** ({_signed(it - base)} s; plan {_signed(plan)} s" + (
        f", model {_signed(-model)} s)" if model is not None else ")"
    )


def _signed(x: float) -> str:
    """``-1.23``, ``+0.40``; a difference that rounds to nothing is ``0.00`` (not ``-0.00``)."""
    text = f"{x:+.2f}"
    return "0.00" if text in ("+0.00", "-0.00") else text


def _planned(plan: dict[str, Any]) -> str:
    """The planned column: the plan with the device lane, the CPU lane's alone beside it when they differ."""
    cpu = plan.get("cpu_lane_iteration_s")
    return f"{plan['iteration_s']:.2f}" + (f" (CPU lane alone {cpu:.2f})" if cpu is not None else "")


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table: one line per cell, with the SysX CFG3 ratios on its default-placement
    row, and a column of each placement's speed-up over its ``+cpu`` sibling when a row has one."""
    placed = any(split_placement(r["schedule"])[1] for r in rows)
    extra = " vs optim.placement=cpu: speed-up (measured saving; plan, model) |" if placed else ""
    lines = [
        "| model | seq | ranks | schedule | measured s/it | measured bubble | planned s/it | planned bubble | "
        "measured/planned | SysX/Mobius | SysX/Megatron |" + extra,
        "|" + "---|" * (11 + placed),
    ]
    by_key = {_key(r): r for r in rows}
    gpus = {r.get("gpu", "v100") for r in rows} != {"v100"}  # name the GPU unless all are the paper's
    for r in rows:
        again = f" ({r['attempts']} runs)" if r.get("attempts", 1) > 1 else ""  # refused before (a hiccup)
        chosen = f" ({r['choice']})" if r.get("choice") else ""
        on = f" on {r.get('gpu', 'v100').upper()}" if gpus else ""
        head = (
            f"| {r['model'].replace('llama2_', '').upper()}{on} | {r['seq']} | {_ranks(r['ranks'], r.get('replicas', 1))} | "
            f"{_label(r['schedule'], r)}{chosen}{again} |"
        )
        tail = f" {vs_cpu(r, rows)} |" if placed else ""
        if "error" in r:
            need = re.search(r"has ([\d.]+ GiB) but .* needs ([\d.]+ GiB) on rank (\d+)", r["error"])
            why = f"needs {need[2]} on rank {need[3]}, the GPU has {need[1]}" if need else r["error"][:90]
            lines.append(head + f" does not fit | | | | {why} | | |" + tail)
            continue
        rep = r["report"]
        plan = rep["plan"]
        m = rep["measured"]
        if m is None:
            cells = f" refused | | {_planned(plan)} | {100 * plan['bubble']:.1f}% | {rep['refused'][:80]} | | |"
        else:
            ratios = ["", ""]
            gpu, model, seq, family, tuned, placement, ranks, replicas = _key(r)
            if family == "sysx:cfg3" and placement is None:  # against the baselines run the same way
                for i, base in enumerate(("mobius", "interleaved_1f1b")):
                    b = _iteration(by_key.get((gpu, model, seq, base, tuned, None, ranks, replicas)))
                    ratios[i] = f"**{b / m['iteration_s']:.2f}x**" if b else "-"
            cells = (
                f" {m['iteration_s']:.2f} | {100 * m['bubble']:.1f}% | {_planned(plan)} | "
                f"{100 * plan['bubble']:.1f}% | {m['over_plan']:.3f} | {ratios[0]} | {ratios[1]} |"
            )
        lines.append(head + cells + tail)
    return "\n".join(lines)


def _throughput(r: dict[str, Any] | None, which: str) -> float | None:
    """Tokens per modelled second of a row, ``measured`` or ``plan`` (None: none)."""
    rep = (r or {}).get("report") or {}
    got = rep.get(which)
    if r is None or not got:
        return None
    replicas = r.get("replicas", 1)
    return replicas * _tokens(r["model"], r["seq"], r["ranks"] // replicas) / got["iteration_s"]


def replica_lines(rows: list[dict[str, Any]]) -> str:
    """Per replica row: its tokens per modelled second, measured and planned, against one pipeline over
    all its ranks at the same global batch and against one replica's pipeline alone (R=1)."""
    by = {(r["model"], r["seq"], r["schedule"], r["ranks"], r.get("replicas", 1)): r for r in rows}
    out = []
    for r in rows:
        n = r.get("replicas", 1)
        if n == 1:
            continue
        key = (r["model"], r["seq"], r["schedule"])
        longer, alone = by.get((*key, r["ranks"], 1)), by.get((*key, r["ranks"] // n, 1))
        parts = []
        for which in ("measured", "plan"):
            mine = _throughput(r, which)
            if mine is None:
                continue
            vs = [
                f"{mine / other:.2f}x {what}"
                for what, x in ((f"one {r['ranks']}-rank pipeline", longer), ("R=1", alone))
                if (other := _throughput(x, which))
            ]
            parts.append(f"{mine:.0f} tokens/s {which}" + (f" ({', '.join(vs)})" if vs else ""))
        head = f"{r['model']} seq {r['seq']} {_label(r['schedule'])} {_ranks(r['ranks'], n)}: "
        out.append(head + ("; ".join(parts) or r.get("error", "no report")[:90]))
    return "\n".join(out)


def averages(rows: list[dict[str, Any]]) -> str:
    """Mean SysX CFG3 speed-up over Mobius and over Megatron, across the rows measured for all three
    (default placement)."""
    got = {
        (*_key(r)[:5], _key(r)[6:]): r["report"]["measured"]["iteration_s"]
        for r in rows
        if (r.get("report") or {}).get("measured") and _placement(r["schedule"]) is None
    }
    gpus = sorted({k[0] for k in got})
    out = []
    for gpu in gpus:  # one GPU's rows at a time: an H100's ratios are not the paper's V100's
        on = f" on {gpu.upper()}" if len(gpus) > 1 else ""
        for tuned in (False, True):
            for base, name in (("mobius", "Mobius"), ("interleaved_1f1b", "Megatron")):
                ratios = [
                    got[(g, m, q, base, tuned, n)] / t
                    for (g, m, q, sch, tu, n), t in got.items()
                    if g == gpu and sch == "sysx:cfg3" and tu == tuned and (g, m, q, base, tuned, n) in got
                ]
                if ratios:
                    out.append(
                        f"SysX/{name}{' (best layouts)' if tuned else ''}{on} {sum(ratios) / len(ratios):.2f}x on "
                        f"average ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rows)"
                    )
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
        fixed = [
            (x["report"]["measured"]["iteration_s"], s)
            for (mm, qq, s), x in got.items()
            if (mm, qq) == (m, q) and s != "sysx:tuned"
        ]
        line = f"{m} seq {q}: tuned {t:.2f} s measured vs {plan:.2f} s predicted ({100 * (t / plan - 1):+.1f}%)"
        if fixed:
            best, name = min(fixed)
            line += f"; best fixed layout {_label(name)} {best:.2f} s: tuned/best {t / best:.3f}"
        out.append(line)
    return "\n".join(out)


def _latest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell: a measured row over a refused one, else the later one; first-seen order."""
    keep: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        key = (r.get("gpu", "v100"), r["model"], r["seq"], r["schedule"], r.get("ranks"), r.get("replicas", 1))
        old = keep.get(key)
        if old is None or (r.get("report") or {}).get("measured") or not (old.get("report") or {}).get("measured"):
            keep[key] = r
    return list(keep.values())


def parse_schedules(schedules: str, placements: str) -> list[str]:
    """``--schedules`` and a ``sysx:cfg3+<placement>`` row per ``--placements`` entry not already named
    (first-seen order). Raises ValueError for an unknown placement."""
    out = [s.strip() for s in schedules.split(",") if s.strip()]
    for placement in (x.strip() for x in placements.split(",") if x.strip()):
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r} in --placements; allowed: {', '.join(PLACEMENTS)}")
        if f"sysx:cfg3+{placement}" not in out:
            out.append(f"sysx:cfg3+{placement}")
    return out


def replica_cells(models: list[str], seqs: str, schedules: list[str], replicas: str) -> dict[int, list[dict[str, Any]]]:
    """``--replicas``: by rank count, each schedule as R replicas of each model's pipeline and as one
    pipeline over the same R x ranks (the same global batch: 16 sequences a node)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for r in (int(x) for x in replicas.split(",") if x.strip()):
        if r < 2:
            raise ValueError(f"--replicas {r}: give replica counts >= 2 (one replica is the plain row)")
        for m in models:
            n = r * MODELS[m][1]
            out.setdefault(n, []).extend(
                {"model": MODELS[m][0], "seq": int(s), "schedule": sch, **({"replicas": r} if k else {})}
                for s in seqs.split(",")
                for sch in schedules
                for k in (True, False)
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="10b,19b,30b,40b", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--seq", default="2048,4096", help="sequence lengths of the emulated costs")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma list of " + ", ".join(SCHEDULES))
    p.add_argument(
        "--gpu",
        choices=list(GPUS),
        default="v100",
        help="the emulated GPU of every cell (emulate.gpu; v100: the paper's cluster)",
    )
    p.add_argument(
        "--placements",
        default="",
        help="comma list of optim.placement values (cpu, split, auto) adding a SysX CFG3 row at each "
        "(as the schedules sysx:cfg3+cpu, ...); the default rows run at auto",
    )
    p.add_argument("--steps", type=int, default=4, help="steps per cell (the first --warmup are not measured)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--time-scale", type=float, default=0.1, help="wall seconds per modelled second")
    p.add_argument(
        "--optimizer-workers",
        type=int,
        default=1,
        help="concurrent CPU Adam steps per rank, sharing its 8 threads (DeepSpeed's single worker: 1)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=1,
        help="run a cell again when its measurement is refused (a busy machine's hiccup), up to this often",
    )
    p.add_argument("--quick", action="store_true", help="10B at seq 2048, Mobius, Megatron and SysX CFG3, 3 steps")
    p.add_argument("--out", type=Path, help="also write the table (and the command) here")
    p.add_argument("--json", type=Path, help="keep every cell's report here (JSON lines)")
    p.add_argument("--trace", action="store_true", help="keep every rank's modelled spans of the last step in --json")
    p.add_argument(
        "--best-layouts",
        action="store_true",
        help="also run each of Mobius, Megatron and SysX CFG3 at its fastest planned layout "
        "(forward stages per rank, SysX split d), the baselines' and SysX's alike",
    )
    p.add_argument(
        "--replicas",
        default="",
        help="comma list of replica counts R: adds every schedule as R replicas of the model's pipeline and "
        "as one pipeline over R x its ranks at the same global batch (parallel.replicas)",
    )
    p.add_argument("--plan-only", action="store_true", help="print every cell's planned iteration, running nothing")
    p.add_argument(
        "--report",
        type=Path,
        nargs="+",
        help="print the table of --json files kept before (a cell measured again: its last row), running nothing",
    )
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    if args.report:
        rows = _latest(
            [json.loads(line) for path in args.report for line in path.read_text().splitlines() if line.strip()]
        )
        print(f"{table(rows)}\n\n{averages(rows)}\n{tuned_lines(rows)}\n{replica_lines(rows)}".rstrip())
        return 0
    if args.quick:
        args.models, args.seq, args.schedules, args.steps = "10b", "2048", "mobius,interleaved_1f1b,sysx:cfg3", 3
    models = [m.strip() for m in args.models.split(",")]
    try:
        schedules = parse_schedules(args.schedules, args.placements)
    except ValueError as err:
        p.error(str(err))
    try:
        bad = [m for m in models if m not in MODELS] + [s for s in schedules if split_layout(s)[0] not in SCHEDULES]
    except ValueError as err:
        p.error(str(err))
    if bad:
        p.error(f"unknown {', '.join(bad)}; models: {', '.join(MODELS)}; schedules: {', '.join(SCHEDULES)}")
    shared = {
        "steps": args.steps,
        "warmup": args.warmup,
        "time_scale": args.time_scale,
        "gpu": args.gpu,
        "optimizer_workers": args.optimizer_workers,
        "spans": args.trace,
        "retries": args.retries,
    }
    out_json = args.json or Path(tempfile.mkstemp(suffix=".jsonl")[1])
    out_json.write_text("")
    t0 = time.perf_counter()
    plans: list[str] = []
    by_ranks: dict[int, list[dict[str, Any]]] = {}
    for m in models:
        by_ranks.setdefault(MODELS[m][1], []).extend(
            {"model": MODELS[m][0], "seq": int(s), "schedule": sch} for s in args.seq.split(",") for sch in schedules
        )
    try:
        replica_rows = replica_cells(models, args.seq, schedules, args.replicas)
    except ValueError as err:
        p.error(str(err))
    for n_ranks, extra in replica_rows.items():
        by_ranks.setdefault(n_ranks, []).extend(extra)
    for n_ranks in sorted(by_ranks):
        cells = by_ranks[n_ranks]
        if args.best_layouts:
            cells += [
                {
                    "model": MODELS[m][0],
                    "seq": int(s),
                    "schedule": best_layout(MODELS[m][0], int(s), n_ranks, sch, shared),
                }
                for m in models
                if MODELS[m][1] == n_ranks
                for s in args.seq.split(",")
                for sch in ("mobius", "interleaved_1f1b", "sysx:cfg3")
            ]
        if args.plan_only:
            plans += plan_table(cells, n_ranks, shared)
            continue
        launch(cells, n_ranks, shared, out_json)
    if args.plan_only:
        print(
            "| model | seq | ranks | schedule | planned s/it | planned tokens/s |\n|---|---|---|---|---|---|\n"
            + "\n".join(plans)
        )
        return 0
    rows = [json.loads(line) for line in out_json.read_text().splitlines() if line.strip()]
    text = f"{table(rows)}\n\n{averages(rows)}\n{tuned_lines(rows)}\n{replica_lines(rows)}".rstrip()
    print(text)
    print(
        f"\n{len(rows)} cells in {time.perf_counter() - t0:.0f} s; paper: SysX {PAPER['sysx_over_mobius']}x Mobius, "
        f"{PAPER['sysx_over_megatron']}x Megatron on average"
    )
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
