"""From a job config to the search and back: the :class:`Job` a config describes, the whole
tuning (cached profile, p2p measured between the ranks, search, advice) and the chosen
configuration written into the config (``schedule.tune=true`` at job start; ``run_dir/config.yaml``
then holds the choice). On ``device=emulated`` the profile is the emulated device's
(:mod:`sysx.autotune.emulated`): nothing is measured."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from sysx import device as dev
from sysx import dist as sdist
from sysx.autotune.advice import Change, advise
from sysx.autotune.cache import cached_profile, load_or_measure, profile_path
from sysx.autotune.contention import Together, cpu_ratio, meeting_seconds, slowdown, time_block_together
from sysx.autotune.emulated import emulated_profile
from sysx.autotune.p2p import P2PFigures, measure_p2p
from sysx.autotune.profile import MachineProfile
from sysx.autotune.report import why
from sysx.autotune.search import Budget, Candidate, Job, Result, candidate_costs, divisors, search
from sysx.checkpoint.pretrained import job_model_config
from sysx.config import ConfigError, SysxConfig
from sysx.config.choices import EMULATED_DEVICE
from sysx.emulate import cluster, emulated_model
from sysx.optim.cores import intra_op_threads, rank_cores
from sysx.schedule.costs import Costs


def job_from_config(cfg: SysxConfig, n_ranks: int, gpus_per_node: int | None, device: torch.device) -> Job:
    """The :class:`Job` of ``cfg`` on ``n_ranks`` ranks (``schedule=auto`` means sysx here), its global
    batch every replica's sequences together and its replicas ``parallel.replicas`` (null: the search
    picks them). On ``device=emulated`` it is the emulated job: ``emulate.model`` at
    ``emulate.seq_len``, micro-batches of ``emulate.micro_batch_size``, the emulated network's GPUs
    per node, 16-bit unless ``precision=fp32``."""
    name = "sysx" if cfg.schedule.name == "auto" else cfg.schedule.name
    if name in ("single", "reference"):
        raise ConfigError(
            f"tuning chooses pipeline configurations; schedule={name} runs one process "
            f"(use schedule=auto or a pipeline schedule)"
        )
    t = cfg.train
    if cfg.device == EMULATED_DEVICE:
        em = emulated_model(cfg)
        return Job(
            model=em.config,
            seq_len=em.seq_len,
            global_batch=cfg.parallel.count * em.micro_batch_size * t.micro_batches,
            n_ranks=n_ranks,
            schedule=name,
            gpus_per_node=cluster(cfg.emulate).gpus_per_node,
            work_dtype="float32" if cfg.precision == "fp32" else "bfloat16",
            optim_backend=cfg.optim.backend,
            rollback=cfg.optim.rollback,
            replicas=cfg.parallel.replicas,
            **_tier(cfg),
        )
    precision = dev.default_precision(device) if cfg.precision == "auto" else cfg.precision
    return Job(
        model=job_model_config(cfg),
        seq_len=t.seq_len,
        global_batch=cfg.parallel.count * t.micro_batch_size * t.micro_batches,
        n_ranks=n_ranks,
        schedule=name,
        gpus_per_node=gpus_per_node,
        work_dtype="float32" if precision == "fp32" else "bfloat16",
        optim_backend=cfg.optim.backend,
        rollback=cfg.optim.rollback,
        replicas=cfg.parallel.replicas,
        **_tier(cfg),
    )


def _tier(cfg: SysxConfig) -> dict[str, Any]:
    """The :class:`Job` fields of ``optim.offload``: with ``nvme`` the drives of ``optim.nvme_dir``,
    measured once per machine and drive (:mod:`sysx.machine.disk_cache`)."""
    if cfg.optim.offload != "nvme":
        return {}
    from sysx.machine.disk_cache import load_or_measure_disk

    try:
        disk, _ = load_or_measure_disk(str(cfg.optim.nvme_dir), cfg.optim.nvme_engine)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    return {"offload": "nvme", "disk": disk}


@dataclass
class Tuning:
    """One tuning: the profile (and whether it came from the cache), the search and its advice."""

    profile: MachineProfile
    reused: bool
    result: Result
    changes: list[Change]


def tune(
    job: Job,
    device: torch.device,
    *,
    adam_backend: str = "auto",
    refresh: bool = False,
    budget: dict[str, float | None] | None = None,
    profile: MachineProfile | None = None,
    p2p: P2PFigures | None = None,
    together_s: list[float] | None = None,
    together_cpu_s: list[float] | None = None,
    meeting_s: float | None = None,
) -> Tuning:
    """Profile (cached), search, advise. ``budget`` bytes override what the profile found free
    (keys ``gpu``, ``host``, ``shm``; None keeps the profile's figure). ``profile``: use this one
    (the emulated device's) instead of the cache. ``p2p``: figures just measured between the job's
    ranks, kept in the cached profile; without them the cached profile's are used if it has some.
    ``together_s``: each rank's time of the Block measured together (:mod:`sysx.autotune.contention`):
    the search charges the profile's layer times their slowdown (not kept in the cache: it is this job's).
    ``together_cpu_s``: the same runs' CPU times, the node's host lane's cost of a layer (:func:`cpu_ratio`).
    ``meeting_s``: what a step's end costs beyond the ranks' compute, measured with them (:func:`meeting_seconds`)."""
    reused = profile is not None
    if profile is None:
        dtype = torch.float32 if job.work_dtype == "float32" else torch.bfloat16
        profile, reused = load_or_measure(
            job.model,
            job.seq_len,
            divisors(job.global_batch),
            dtype=dtype,
            device=device,
            refresh=refresh,
            adam_backend=adam_backend,
            p2p=p2p,
            threads=rank_cores(job.ranks_per_node),
        )
    if together_s:
        profile = dataclasses.replace(profile, slowdown=slowdown(profile, job.seq_len, together_s))
    if together_cpu_s:
        profile = dataclasses.replace(profile, cpu_ratio=cpu_ratio(profile, job.seq_len, together_cpu_s))
    if meeting_s is not None:
        profile = dataclasses.replace(profile, meeting_s=meeting_s)
    given = budget or {}
    found = {"gpu": profile.hardware.device_free_bytes, "host": profile.host_available, "shm": profile.shm_free}
    if job.disk is not None and job.disk.free_bytes is not None:  # optim.offload=nvme: the state files' room
        found["disk"] = job.disk.free_bytes
    limits = Budget(**{k: float(v if (g := given.get(k)) is None else g) for k, v in found.items()})
    result = search(job, limits, profile)
    return Tuning(profile, reused, result, advise(result, profile))


def job_profile(cfg: SysxConfig, job: Job) -> MachineProfile | None:
    """The profile a job is tuned with when it is not measured: the emulated device's, else None."""
    return emulated_profile(cfg, divisors(job.global_batch)) if cfg.device == EMULATED_DEVICE else None


def cached_costs(
    cfg: SysxConfig, n_ranks: int, ranks_per_node: int, device: torch.device, *, workers: int, threads: int
) -> Costs | None:
    """The costs of ``cfg``'s job from this machine's cached profile (its micro-batch size, the run's
    optimizer workers and threads), or None when none is cached: nothing is measured here."""
    job = dataclasses.replace(job_from_config(cfg, n_ranks, ranks_per_node, device), replicas=cfg.parallel.count)
    dtype = torch.float32 if job.work_dtype == "float32" else torch.bfloat16
    profile = cached_profile(job.model, job.seq_len, dtype, device, rank_cores(ranks_per_node))
    if profile is None:
        return None
    return candidate_costs(job, profile, cfg.train.micro_batch_size, workers, threads)


def choice(cand: Candidate, *, emulated: bool = False) -> dict[str, Any]:
    """The config keys a candidate sets (``section.key``: value; ``parallel.replicas`` when it runs
    several). On the emulated device the micro-batch size is the emulated one
    (``emulate.micro_batch_size``); the real tensors keep ``train.micro_batch_size``."""
    o = cand.options
    mbs_key = "emulate.micro_batch_size" if emulated else "train.micro_batch_size"
    return ({"parallel.replicas": cand.replicas} if cand.replicas > 1 else {}) | {
        "schedule.stages_per_rank": o.stages_per_rank,
        "schedule.split": o.split,
        "schedule.cfg": o.cfg,
        "schedule.param_buffers": o.param_buffers,
        "optim.workers": o.optimizer_workers,
        mbs_key: cand.micro_batch_size,
        "train.micro_batches": cand.micro_batches,
    }


def apply_choice(cfg: SysxConfig, keys: dict[str, Any]) -> SysxConfig:
    """``cfg`` with ``keys`` (from :func:`choice`) set; every section validated again."""
    sections: dict[str, dict[str, Any]] = {}
    for path, value in keys.items():
        section, key = path.split(".")
        sections.setdefault(section, {})[key] = value
    new = {name: dataclasses.replace(getattr(cfg, name), **values) for name, values in sections.items()}
    for section in new.values():
        section.validate()
    return dataclasses.replace(cfg, **new)


def no_fit_message(tuning: Tuning) -> str:
    """Why nothing runs: the closest candidate and the changes that make one fit."""
    closest = tuning.result.closest
    lines = ["schedule.tune: no configuration fits the memory budgets"]
    if closest is not None:
        lines.append(
            f"closest: {closest.label()} (needs "
            + ", ".join(f"{r} {100 * v:.0f}%" for r, v in closest.over.items())
            + " of the budget)"
        )
    lines += [f"change: {ch.text}" for ch in tuning.changes] or ["no single change found: try a smaller model"]
    return "\n".join(lines)


@dataclass
class TunedJob:
    """What ``schedule.tune=true`` gives a job: the config with the choice, and on rank 0 the costs
    the winner was predicted with (the run's prediction, :mod:`sysx.autotune.check`)."""

    cfg: SysxConfig
    costs: Costs | None = None


def _wants_p2p(cfg: SysxConfig, job: Job, device: torch.device) -> bool:
    """Rank 0: must the ranks measure p2p now (no cached profile with figures for this layout)?"""
    if cfg.device == EMULATED_DEVICE or job.n_ranks < 2:
        return False
    dtype = torch.float32 if job.work_dtype == "float32" else torch.bfloat16
    path = profile_path(job.model, job.seq_len, dtype, device, rank_cores(job.ranks_per_node))
    if not path.exists():
        return True
    try:
        cached = MachineProfile.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, TypeError, KeyError):
        return True
    p = cached.p2p
    return p is None or (p.ranks, p.ranks_per_node) != (job.n_ranks, job.ranks_per_node)


def _time_together(cfg: SysxConfig, job: Job, device: torch.device, info: Any, group: Any) -> list[Together] | None:
    """Every rank's seconds of the job's Block and its meeting rounds, all timing at once
    (:mod:`sysx.autotune.contention`), on rank 0; None where the ranks do not share the compute (a
    GPU, the emulated device)."""
    if cfg.device == EMULATED_DEVICE or dev.is_cuda(device):
        return None
    dtype = torch.float32 if job.work_dtype == "float32" else torch.bfloat16
    many = info.world_size > 1

    def meet(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=group)
        return float(t.item())

    with intra_op_threads(rank_cores(job.ranks_per_node)):  # as the ranks will compute, and as profiled
        mine = time_block_together(
            job.model,
            job.seq_len,
            dtype,
            barrier=(lambda: tdist.barrier(group=group)) if many else None,
            meet=meet if many else None,
        )
    every: list[Any] = [None] * info.world_size
    if many:
        tdist.all_gather_object(every, tuple(mine), group=group)
    else:
        every = [tuple(mine)]
    return [Together(float(wall), float(cpu), [(float(a), float(b)) for a, b in met]) for wall, cpu, met in every]


def tune_job(cfg: SysxConfig, info: Any, device: torch.device) -> TunedJob:
    """``schedule.tune=true`` at job start: every rank measures p2p together when the cached profile
    lacks it, then rank 0 profiles and searches, and every rank takes its choice (all ranks must
    build the same schedule, and profiles measured on each would differ).

    ``info`` is the job's :class:`sysx.dist.DistInfo`. Raises :class:`ConfigError` with the closest
    candidate and the changes to make when nothing fits.
    """
    job = job_from_config(cfg, info.world_size, info.local_world_size, device)
    group = sdist.cpu_group() if info.world_size > 1 else None
    flag = [_wants_p2p(cfg, job, device) if info.is_main else None]
    if info.world_size > 1:
        tdist.broadcast_object_list(flag, src=0, group=group)
    p2p = None
    if flag[0]:  # over the job's main group and device: the links its messages take
        on = device if dev.is_cuda(device) else torch.device("cpu")
        p2p = measure_p2p(info.rank, info.world_size, job.ranks_per_node, on, None)
    together = _time_together(cfg, job, device, info, group)
    box: list[Any] = [None]
    costs = None
    if info.is_main:
        tuning = tune(
            job,
            device,
            adam_backend=cfg.optim.backend,
            profile=job_profile(cfg, job),
            p2p=p2p,
            together_s=[t.wall for t in together] if together else None,
            together_cpu_s=[t.cpu for t in together] if together else None,
            meeting_s=meeting_seconds([t.rounds for t in together]) if together else None,
        )
        best = tuning.result.best
        box[0] = choice(best, emulated=cfg.device == EMULATED_DEVICE) if best is not None else no_fit_message(tuning)
        if best is not None:
            # the winner's replicas (the job's may be None: the search picked them), so the run's
            # prediction is of what runs: every replica's memory, the reductions and the exchange
            won = dataclasses.replace(job, replicas=best.replicas)
            costs = candidate_costs(
                won, tuning.profile, best.micro_batch_size, best.options.optimizer_workers or 1, best.threads_per_worker
            )
        how = (
            "the emulated device's"
            if cfg.device == EMULATED_DEVICE
            else "cached"
            if tuning.reused
            else f"measured in {tuning.profile.seconds:.1f} s"
        )
        links = f"; {tuning.profile.p2p.describe()}" if tuning.profile.p2p is not None else ""
        if tuning.profile.slowdown is not None:
            links += f"; layers {tuning.profile.slowdown:.2f}x the profile's with every rank computing"
        if tuning.profile.meeting_s:
            links += f", {tuning.profile.meeting_s * 1e3:.1f} ms a step meeting"
        print("schedule.tune (profile " + how + links + "):\n  " + "\n  ".join(why(tuning.result, None)), flush=True)
    if info.world_size > 1:
        tdist.broadcast_object_list(box, src=0, group=group)
    if isinstance(box[0], str):
        raise ConfigError(box[0])
    return TunedJob(apply_choice(cfg, box[0]), costs)


def tuned_job_config(cfg: SysxConfig, info: Any, device: torch.device) -> SysxConfig:
    """:func:`tune_job`'s config (every rank's choice)."""
    return tune_job(cfg, info, device).cfg
