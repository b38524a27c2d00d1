"""``sysx plan``: build, validate and simulate a schedule; print the plan; draw the timeline.

    sysx plan --schedule sysx --ranks 4 --microbatches 4 --stages 8 --split 2 --t-opt 6 --png fig8.png

Unit costs by default (the paper's figures); ``--model PRESET`` or ``--hydra key=value ...`` plans a
model with costs from the hardware flags, ``--compare [LIST]`` draws several schedules on one time
axis, ``--json`` prints one JSON object and ``--config FILE.yaml`` reads the same options.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

from sysx.config import ScheduleSection, SysxConfig
from sysx.config.choices import EMULATED_DEVICE, PRECISIONS, SYSX_CFGS
from sysx.emulate import emulated_model
from sysx.emulate.device_model import emulated_schedule
from sysx.emulate.profiles import cluster
from sysx.machine.disk_plan import add_disk_arguments, resolve_disk
from sysx.partition import Partition, PartitionError, partition_model, uniform_partition
from sysx.plan_nvme import replanner, tier_lines, tier_summary
from sysx.plan_replicas import ReplicaPlan, replica_plan
from sysx.replicas import ReplicaLayout
from sysx.runtime.options import make_schedule, options_from_config
from sysx.schedule import ONE_STAGE_PER_RANK, SCHEDULES, build
from sysx.schedule.costs import Costs, UnitCosts, costs_from_model, model_layer_params
from sysx.schedule.ops import Schedule, ScheduleError
from sysx.schedule.replica_costs import ADAM_BYTES_PER_PARAM, ReplicaCosts
from sysx.schedule.simulate import Timeline, simulate
from sysx.schedule.validate import validate

GIB = float(1 << 30)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sysx plan", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", help="YAML file with these options (flags override it)")
    p.add_argument(
        "--hydra",
        nargs="*",
        metavar="KEY=VALUE",
        default=None,
        help="compose the training config (conf/) with these overrides and plan for it (device=emulated: "
        "the emulated cluster's plan, as the run is timed against it)",
    )
    _layout_arguments(p)
    u = p.add_argument_group("unit-cost mode (no --model)")
    u.add_argument("--t-fwd", type=float, default=1.0, help="forward of one stage on one micro-batch")
    u.add_argument("--t-bwd", type=float, default=2.0, help="whole backward of one stage (recompute included)")
    u.add_argument("--t-opt", type=float, default=0.0, help="CPU optimizer step of one forward stage")
    _model_arguments(p.add_argument_group("model mode"))
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="ranks per node, for shared memory and --inter-gbps (default all)",
    )
    add_disk_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument(
        "--compare",
        nargs="?",
        const="all",
        default=None,
        help="simulate several schedules: all | ablation | comma list (e.g. mobius,sysx:cfg0,sysx)",
    )
    o.add_argument("--ops", action="store_true", help="print every rank's op list")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    o.add_argument("--png", help="write the timeline picture here")
    o.add_argument("--trace", help="write a Chrome trace JSON here (open in Perfetto)")
    return p


def _layout_arguments(p: argparse.ArgumentParser) -> None:
    """Which schedule, on how many ranks, cut how (defaults: the layout ``sysx-train`` runs)."""
    p.add_argument("--schedule", default=None, choices=SCHEDULES, help="default sysx")
    p.add_argument("--ranks", "-g", type=int, default=None, help="Ng: ranks (GPUs) of the job, default 4")
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="R: data-parallel replicas of a pipeline of Ng/R ranks (default parallel.replicas, else 1)",
    )
    p.add_argument("--microbatches", "-m", type=int, default=None, help="Nm: micro-batches per iteration, default 4")
    p.add_argument(
        "--stages", "-s", type=int, default=None, help="Nsf: forward stages (default 2*Ng; Ng for gpipe/1f1b)"
    )
    p.add_argument(
        "--split",
        "-d",
        type=int,
        default=None,
        help="d: backward sub-stages per forward stage (sysx), default sysx-train's (3; 2 for --cfg 1; 1 for --cfg 0)",
    )
    p.add_argument(
        "--cfg", type=int, default=None, choices=SYSX_CFGS, help="sysx ablation config (paper Table 3), default 3"
    )
    p.add_argument(
        "--param-buffers", type=int, default=None, help="GPU parameter buffers per rank (current + prefetch), default 2"
    )
    p.add_argument(
        "--precision",
        default=None,
        choices=PRECISIONS,
        help="working-copy precision: bytes per parameter in GPU buffers and shared memory (default bf16)",
    )


def _model_arguments(m: argparse._ArgumentGroup) -> None:
    """A model preset's costs on hardware given by its figures."""
    m.add_argument("--model", help="a sysx.model preset (tiny, llama2_7b, llama2_10b, ...)")
    m.add_argument("--seq-len", type=int, default=None, help="default 2048")
    m.add_argument("--micro-batch-size", type=int, default=None, help="default 1")
    m.add_argument("--stage-sizes", help="manual partition: layers per forward stage, e.g. 13,12,12,13")
    m.add_argument("--gpu-tflops", type=float, default=50.0, help="achieved TFLOP/s of one GPU")
    m.add_argument("--p2p-gbps", type=float, default=10.0, help="GPU<->GPU bandwidth, GB/s")
    m.add_argument("--p2p-latency-us", type=float, default=20.0)
    m.add_argument(
        "--inter-gbps",
        type=float,
        default=None,
        help="GPU<->GPU bandwidth between nodes (with --gpus-per-node), GB/s (default --p2p-gbps)",
    )
    m.add_argument(
        "--inter-latency-us", type=float, default=None, help="latency between nodes (default --p2p-latency-us)"
    )
    m.add_argument("--h2d-gbps", type=float, default=12.0, help="host->GPU bandwidth (parameter prefetch), GB/s")
    m.add_argument("--d2h-gbps", type=float, default=12.0, help="GPU->host bandwidth (gradient offload), GB/s")
    m.add_argument("--optim-gparams-per-s", type=float, default=2.0, help="CPU Adam throughput of one optimizer worker")
    m.add_argument(
        "--optim-workers", type=int, default=None, help="concurrent async optimizer steps per rank (default unlimited)"
    )
    m.add_argument("--rendezvous", action="store_true", help="sync sends wait for the receiver (default: eager)")
    m.add_argument(
        "--posted-sends",
        action="store_true",
        help="sends are posted isends, the transfer runs once the receive is posted (the runtime's)",
    )


def _config_defaults(path: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(data, dict):
        raise SystemExit(f"sysx plan: {path} must hold a mapping of options")
    if isinstance(data.get("plan"), dict):
        data = data["plan"]
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _entries(spec: str) -> list[tuple[str, int]]:
    if spec == "all":
        return [(name, 3) for name in SCHEDULES]
    if spec == "ablation":
        return [("mobius", 3)] + [("sysx", c) for c in range(4)]
    out = []
    for item in spec.split(","):
        item = item.strip()
        name, _, cfg = item.partition(":cfg")
        if name not in SCHEDULES or (cfg and cfg not in "0123"):
            raise SystemExit(
                f"sysx plan: unknown --compare entry {item!r}; use one of {', '.join(SCHEDULES)}, "
                f"sysx:cfg0..sysx:cfg3, 'all' or 'ablation'"
            )
        out.append((name, int(cfg) if cfg else 3))
    return out


_JOB = ScheduleSection()  # sysx-train's defaults
DEFAULTS = {
    "schedule": "sysx",
    "ranks": 4,
    "microbatches": 4,
    "cfg": _JOB.cfg,
    "param_buffers": _JOB.param_buffers,
    "seq_len": 2048,
    "micro_batch_size": 1,
    "precision": "bf16",
}
_COUNTS = ("ranks", "replicas", "microbatches", "stages", "split", "seq_len", "micro_batch_size", "param_buffers")


def _resolve(args: argparse.Namespace) -> None:
    """Fill unset options: flags (and --config) first, then the Hydra config, then DEFAULTS. The
    layout (``--stages``, ``--split``) left unset is the one ``sysx-train`` runs (:func:`runtime_layout`)."""
    args.model_cfg, args.job, args.emulated, args.table = None, None, "", None
    found: dict[str, Any] = {}
    if args.hydra is not None:
        from sysx.checkpoint.pretrained import job_model_config
        from sysx.config import load_config

        job = args.job = load_config(args.hydra)
        args.model_cfg = job_model_config(job)
        args.model = args.model or job.model.preset
        found = {
            "seq_len": job.train.seq_len,
            "micro_batch_size": job.train.micro_batch_size,
            "microbatches": job.train.micro_batches,
            "precision": "bf16" if job.precision == "auto" else job.precision,
            "cfg": job.schedule.cfg,
            "param_buffers": job.schedule.param_buffers,
        }  # a plan is for GPUs: auto is bf16 there
        if job.schedule.name in SCHEDULES:
            found["schedule"] = job.schedule.name
        if job.parallel.replicas is not None:
            found["replicas"] = job.parallel.replicas
        if job.schedule.split is not None:
            found["split"] = job.schedule.split
        if job.device == EMULATED_DEVICE:  # the emulated model's costs, at its shape
            emulated = emulated_model(job)
            args.model, args.model_cfg = emulated.name, emulated.config
            found.update(seq_len=emulated.seq_len, micro_batch_size=emulated.micro_batch_size)
    elif args.model:
        from sysx.model import get_preset

        args.model_cfg = get_preset(args.model)
    for key, value in {**DEFAULTS, **found}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, found.get(key, value))
    for key in _COUNTS:
        value = getattr(args, key, None)
        if value is not None and value < 1:
            raise ValueError(f"--{key.replace('_', '-')} {value} is not valid: must be an integer >= 1")
    _resolve_replicas(args)
    resolve_disk(args, args.job and args.job.optim)
    if args.disk is not None and args.model_cfg is None:
        raise ValueError("--offload nvme needs a model (--model or --hydra): unit costs have no bytes")


def _resolve_replicas(args: argparse.Namespace) -> None:
    """``--ranks`` is the job's ranks; with ``--replicas R`` (or ``parallel.replicas``) the plan is
    of a pipeline of ``ranks / R`` ranks run by R replicas (``args.ranks`` becomes P)."""
    args.show_replicas = args.replicas is not None
    args.replicas = args.replicas or 1
    args.world = args.ranks
    if args.show_replicas:
        args.ranks = ReplicaLayout.of(args.replicas, args.ranks).pipeline  # ValueError: one line
        if args.replicas > 1 and args.model_cfg is None:
            raise ValueError(f"--replicas {args.replicas} needs a model (--model or --hydra): unit costs have no links")


def runtime_layouts(
    name: str, cfg: int, n_ranks: int, *, stages_per_rank: int | None = None, n_flat_layers: int | None = None
) -> list[tuple[int, int]]:
    """``(Nsf, d)`` ``sysx-train`` tries for schedule ``name`` at ``n_ranks`` ranks, preferred first
    (:meth:`sysx.runtime.options.PipelineOptions.candidates`: the first that fits the model runs;
    ``n_flat_layers``: the model's, for the layouts cut by Block)."""
    per_rank = None if name in ONE_STAGE_PER_RANK else stages_per_rank
    section = dataclasses.replace(_JOB, name=name, cfg=cfg, stages_per_rank=per_rank)
    return options_from_config(SysxConfig(schedule=section)).candidates(n_ranks, n_flat_layers)


def _partition_for(args: argparse.Namespace, name: str, n_stages: int, split: int, manual: bool) -> Partition | None:
    if args.model_cfg is None:
        return None
    cfg = args.model_cfg
    sizes = None
    if manual and args.stage_sizes:
        try:
            sizes = [int(x) for x in str(args.stage_sizes).split(",")]
        except ValueError:
            raise PartitionError(f"--stage-sizes {args.stage_sizes!r} must be comma-separated layer counts") from None
    return partition_model(
        cfg,
        args.seq_len,
        n_stages,
        split=split if name == "sysx" else 1,
        stage_sizes=sizes,
        n_ranks=args.ranks if name == "sysx" else None,
    )


def _costs(args: argparse.Namespace, scale: float) -> Costs | UnitCosts:
    if args.model_cfg is None:
        return UnitCosts(args.t_fwd * scale, args.t_bwd * scale, args.t_opt * scale, optim_workers=args.optim_workers)
    from sysx.memory.budget import training_state_bytes

    work = "float32" if args.precision == "fp32" else "bfloat16"
    nbytes = 4 if args.precision == "fp32" else 2
    return costs_from_model(
        args.model_cfg,
        args.seq_len,
        args.micro_batch_size,
        gpu_flops=args.gpu_tflops * 1e12,
        dtype_bytes=nbytes,
        host_bytes_per_param=float(training_state_bytes(work).optimizer),
        p2p_bandwidth=args.p2p_gbps * 1e9,
        p2p_latency=args.p2p_latency_us * 1e-6,
        h2d_bandwidth=args.h2d_gbps * 1e9,
        d2h_bandwidth=args.d2h_gbps * 1e9,
        optim_params_per_s=args.optim_gparams_per_s * 1e9,
        optim_workers=args.optim_workers,
        rendezvous=args.rendezvous,
        posted_sends=args.posted_sends,
        gpus_per_node=args.gpus_per_node,
        inter_p2p_bandwidth=None if args.inter_gbps is None else args.inter_gbps * 1e9,
        inter_p2p_latency=None if args.inter_latency_us is None else args.inter_latency_us * 1e-6,
        replica=_replica_costs(args),
    )


def _replica_costs(args: argparse.Namespace) -> ReplicaCosts | None:
    """The replicas on the links of the flags (between nodes: ``--inter-gbps``, else ``--p2p-gbps``;
    in a node's memory: one reducer thread at one optimizer worker's bandwidth)."""
    if args.replicas == 1:
        return None
    layout = ReplicaLayout(args.replicas, args.ranks, 0, local_world_size=args.gpus_per_node or args.world)
    return ReplicaCosts(
        args.replicas,
        layout.peers_share_node(),
        link_bandwidth=(args.inter_gbps or args.p2p_gbps) * 1e9,
        link_latency=(args.p2p_latency_us if args.inter_latency_us is None else args.inter_latency_us) * 1e-6,
        memory_bandwidth=args.optim_gparams_per_s * 1e9 * ADAM_BYTES_PER_PARAM,
        param_bytes=4.0 if args.precision == "fp32" else 2.0,
    )


def plan_one(args: argparse.Namespace, name: str, cfg: int, *, fit: bool) -> tuple[Schedule, Timeline, str]:
    """Build, validate and simulate one schedule; ``fit`` lets gpipe/1f1b take Ng stages."""
    if args.job is not None and args.job.device == EMULATED_DEVICE:
        return _plan_emulated(args, name, cfg)
    per_rank = args.job.schedule.stages_per_rank if args.job is not None else None
    flat = None if args.model_cfg is None else args.model_cfg.n_layers + 2
    layouts = runtime_layouts(name, cfg, args.ranks, stages_per_rank=per_rank, n_flat_layers=flat)
    # the flags fix what they give; the rest is the runtime's, the first that fits the model, as the run picks
    tried = dict.fromkeys(
        (args.stages if args.stages is not None else nsf, args.split if args.split is not None else d)
        for nsf, d in layouts
    )
    first: PartitionError | None = None
    for nsf, split in tried:
        try:
            return _plan_layout(args, name, cfg, nsf, split, fit=fit)
        except PartitionError as err:
            first = first or err
    assert first is not None
    raise first


def _plan_layout(
    args: argparse.Namespace, name: str, cfg: int, nsf: int, split: int, *, fit: bool
) -> tuple[Schedule, Timeline, str]:
    """One schedule at ``nsf`` forward stages of ``split`` sub-stages (see :func:`plan_one`)."""
    note, scale, manual = "", 1.0, True
    if fit and name in ONE_STAGE_PER_RANK and nsf != args.ranks:
        if args.model_cfg is None and nsf % args.ranks:
            raise PartitionError(
                f"{name} needs Nsf = Ng = {args.ranks} stages; with --stages {nsf} the unit costs "
                f"cannot be merged evenly into {args.ranks} stages (use a multiple of {args.ranks})"
            )
        if args.model_cfg is not None:
            note = f"{args.ranks} stages, one per rank"
        else:
            scale = nsf / args.ranks
            note = f"{args.ranks} stages of {nsf // args.ranks} unit stages each, costs x{scale:g}"
        nsf, manual = args.ranks, False
    part = _partition_for(args, name, nsf, split, manual)
    if part is None and name == "sysx":
        part = uniform_partition(nsf, split)
    sched = build(
        name,
        args.ranks,
        args.microbatches,
        part,
        n_stages=nsf,
        split=split,
        cfg=cfg,
        param_buffers=args.param_buffers,
    )
    validate(sched)
    costs = _costs(args, scale)
    args.table = costs.table(sched) if isinstance(costs, Costs) else None
    tl = simulate(sched, args.table or costs, gpus_per_node=args.gpus_per_node)
    return sched, tl, note


def _plan_emulated(args: argparse.Namespace, name: str, cfg: int) -> tuple[Schedule, Timeline, str]:
    """``--hydra device=emulated ...``: the plan the emulated run is timed against, built as the run
    builds it (:func:`sysx.emulate.device_model.emulated_schedule`: the schedule ``sysx-train``
    makes for the emulated model, on the emulated cluster's costs); the layout flags are the job's
    ``schedule.*`` keys (``--stages``: ``schedule.stages_per_rank`` times the ranks)."""
    section: dict[str, Any] = {"name": name, "cfg": cfg, "param_buffers": args.param_buffers}
    if args.split is not None and name == "sysx":
        section["split"] = args.split
    if args.stages is not None and name not in ONE_STAGE_PER_RANK:
        if args.stages % args.ranks:
            raise ValueError(f"--stages {args.stages} with device=emulated must be a multiple of --ranks {args.ranks}")
        section["stages_per_rank"] = args.stages // args.ranks
    if args.stage_sizes:
        section["stage_sizes"] = [int(x) for x in str(args.stage_sizes).split(",")]
    job = dataclasses.replace(args.job, schedule=dataclasses.replace(args.job.schedule, **section))
    build = functools.partial(
        make_schedule,
        options_from_config(job),
        n_ranks=args.ranks,
        n_micro=args.microbatches,
        micro_batch_size=job.train.micro_batch_size,
        ranks_per_node=cluster(job.emulate).gpus_per_node,  # the node a spread last step stays on
        spread_allowed=(args.replicas or 1) == 1 and job.optim.offload == "host",
    )
    sched, plan = emulated_schedule(job, build, backend=job.optim.backend, replicas=args.replicas)
    args.emulated, args.table, args.gpus_per_node = (
        f"emulated: {plan.describe()}",
        plan.table,
        plan.cluster.gpus_per_node,
    )
    return sched, plan.timeline, ""


def _fmt_mem(x: float, unit: str) -> str:
    return f"{x:.3g}" if unit == "units" else f"{x / GIB:.2f}"


def _report(sched: Schedule, tl: Timeline, args: argparse.Namespace) -> str:
    from sysx.schedule.draw import title_of

    u = tl.unit
    lines = [title_of(tl), ""]
    if args.model_cfg is not None:
        lines += [
            f"partition of {args.model} (forward FLOPs per token, {sched.n_stages} stages, d={sched.split}):",
            sched.partition.describe(),
            "",
        ]
    else:
        lines += [
            f"unit costs: forward stage {args.t_fwd:g}, stage backward {args.t_bwd:g} "
            f"(sub-stage {args.t_bwd / sched.split:g}), optimizer per stage {args.t_opt:g}; copies and p2p free",
            "",
        ]
    if u == "units":
        lines.append("memory in units: one forward stage's parameters = 1, one checkpoint = 1")
        head = f"{'params':>7} {'grads':>7} {'ckpts':>7} {'host':>7}"
        cols = [tl.peak_params, tl.peak_grads, tl.peak_ckpts, tl.host]
    else:
        head = f"{'GPU GiB':>8} {'params':>7} {'grads':>7} {'ckpts':>7} {'work':>7} {'host':>7}"
        cols = [tl.peak_gpu, tl.peak_params, tl.peak_grads, tl.peak_ckpts, tl.peak_work, tl.host]
    lines.append(f"{'rank':>4} {'busy':>9} {'idle':>9} {'bubble':>7} {'gpu end':>9}   peak: {head}")
    for r in range(tl.n_ranks):
        mem = " ".join(f"{_fmt_mem(c[r], u):>{8 if i == 0 and u != 'units' else 7}}" for i, c in enumerate(cols))
        lines.append(
            f"{r:>4} {tl.busy[r]:>9.4g} {tl.iteration - tl.busy[r]:>9.4g} {100 * tl.bubble[r]:>6.1f}% "
            f"{tl.gpu_end[r]:>9.4g}         {mem}"
        )
    lines.append("")
    unit = "" if u == "units" else " GiB"
    work = "fp32 working-copy" if args.precision == "fp32" else f"16-bit ({args.precision})"
    masters = "" if args.precision == "fp32" else "fp32 master weights, "
    lines.append(
        f"shared memory per node ({work} parameters owned or run forward there): "
        + ", ".join(f"node {i}: {_fmt_mem(x, u)}{unit}" for i, x in enumerate(tl.shm))
    )
    gpn = tl.gpus_per_node
    lines.append(
        f"host memory per node ({masters}Adam m and v, fp32 gradients of owned sub-stages): "
        + ", ".join(f"node {i}: {_fmt_mem(sum(tl.host[i * gpn : (i + 1) * gpn]), u)}{unit}" for i in range(len(tl.shm)))
    )
    exposed = tl.iteration - max(tl.gpu_end)
    lines.append(
        f"iteration {tl.iteration:.6g}{'' if u == 'units' else ' s'}   bubble ratio {100 * tl.bubble_ratio:.2f}%   "
        f"optimizer time after the last backward {exposed:.4g}"
    )
    n_ops = sum(len(x) for x in sched.ops)
    n_msg = sum(1 for ops in sched.ops for op in ops if op.kind.name.startswith("SEND"))
    lines.append(
        f"validated: {n_ops} ops, {n_msg} messages, {sum(1 for c in sched.ckpt_plan if c.mode != 'local')} "
        f"checkpoint transfers, no deadlock"
    )
    return "\n".join(lines)


def _replica_plan(args: argparse.Namespace, sched: Schedule, tl: Timeline) -> ReplicaPlan | None:
    """The replicas' figures of the plan (None: unit costs, nothing to say about links)."""
    if args.table is None:
        return None
    return replica_plan(
        sched,
        args.table,
        tl,
        gpus_per_node=args.gpus_per_node,
        tokens_per_micro=args.seq_len * args.micro_batch_size,
        layer_numels=model_layer_params(args.model_cfg),
        dtype="float32" if args.precision == "fp32" else "bfloat16",
    )


def _json_extra(
    args: argparse.Namespace, first: tuple[Schedule, Timeline, str], replicas: ReplicaPlan | None
) -> dict[str, Any]:
    """``--json``'s keys beside the timeline: the emulated cluster, the replicas' and the NVMe tier's figures."""
    extra: dict[str, Any] = {"emulated": args.emulated} if args.emulated else {}
    extra.update({"replica_plan": replicas.summary()} if replicas else {})
    if args.disk and not args.compare:
        extra["nvme"] = tier_summary(args, first[0], first[1], replanner(plan_one, args, args.schedule, args.cfg))
    return extra


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sysx plan``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        defaults = _config_defaults(pre.config)
        known = {a.dest for a in parser._actions}
        unknown = sorted(set(defaults) - known)
        if unknown:
            print(f"sysx plan: unknown option(s) {unknown} in {pre.config}", file=sys.stderr)
            return 2
        parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    try:
        _resolve(args)
    except ValueError as err:  # ConfigError and unknown presets
        print(f"sysx plan: {err}", file=sys.stderr)
        return 2
    if args.compare and args.stages is None:
        args.stages = 2 * args.ranks  # one model for every schedule; gpipe/1f1b merge stages pairwise
    try:
        if args.compare:
            runs = [plan_one(args, name, cfg, fit=True) for name, cfg in _entries(args.compare)]
        else:
            runs = [plan_one(args, args.schedule, args.cfg, fit=False)]
    except (ScheduleError, PartitionError, ValueError) as err:
        print(f"sysx plan: {err}", file=sys.stderr)
        return 2
    timelines = [tl for _, tl, _ in runs]
    if args.png:
        from sysx.schedule.draw import draw_compare

        draw_compare(timelines, args.png)
    if args.trace:
        from sysx.schedule.draw import chrome_trace

        chrome_trace(timelines, args.trace)
    replicas = _replica_plan(args, *runs[0][:2]) if args.show_replicas and not args.compare else None
    if args.json:
        out = [
            dict(tl.summary(), cfg=s.options.cfg, stages=s.n_stages, split=s.split, note=note) for s, tl, note in runs
        ]
        extra = _json_extra(args, runs[0], replicas)
        print(json.dumps({**out[0], **extra} if not args.compare else {"compare": out, **extra}))
        return 0
    if args.emulated:
        print(args.emulated)
    if args.compare:
        from sysx.schedule.draw import title_of

        print(
            f"{'schedule':<34} {'iteration':>10} {'bubble':>8} {'after last bwd':>15}"
            + ("" if timelines[0].unit == "units" else f" {'GPU GiB':>8}")
        )
        for _, tl, note in runs:
            label = title_of(tl).split("   ")[0]
            print(
                f"{label:<34} {tl.iteration:>10.4g} {100 * tl.bubble_ratio:>7.1f}% "
                f"{tl.iteration - max(tl.gpu_end):>15.4g}"
                + ("" if tl.unit == "units" else f" {_fmt_mem(max(tl.peak_gpu), tl.unit):>8}")
                + (f"   ({note})" if note else "")
            )
    else:
        sched, tl, _ = runs[0]
        if args.ops:
            print(sched.format_ops())
            print()
        print(_report(sched, tl, args))
        for line in replicas.describe() if replicas else []:
            print(line)
        for line in (
            tier_lines(args, sched, tl, replanner(plan_one, args, args.schedule, args.cfg)) if args.disk else []
        ):
            print(line)
    for path in (args.png, args.trace):
        if path:
            print(f"wrote {Path(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
