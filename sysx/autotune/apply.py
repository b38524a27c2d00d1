"""From a job config to the search and back: the :class:`Job` a config describes, the whole
tuning (cached profile, search, advice) and the chosen configuration written into the config
(``schedule.tune=true`` at job start; ``run_dir/config.yaml`` then holds the choice)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as tdist

from sysx import device as dev
from sysx import dist as sdist
from sysx.autotune.advice import Change, advise
from sysx.autotune.cache import load_or_measure
from sysx.autotune.profile import MachineProfile
from sysx.autotune.report import why
from sysx.autotune.search import Budget, Candidate, Job, Result, divisors, search
from sysx.config import ConfigError, SysxConfig, model_config


def job_from_config(cfg: SysxConfig, n_ranks: int, gpus_per_node: Optional[int], device: torch.device) -> Job:
    """The :class:`Job` of ``cfg`` on ``n_ranks`` ranks (``schedule=auto`` means sysx here)."""
    name = "sysx" if cfg.schedule.name == "auto" else cfg.schedule.name
    if name in ("single", "reference"):
        raise ConfigError(f"tuning chooses pipeline configurations; schedule={name} runs one process "
                          f"(use schedule=auto or a pipeline schedule)")
    precision = dev.default_precision(device) if cfg.precision == "auto" else cfg.precision
    return Job(model=model_config(cfg), seq_len=cfg.train.seq_len,
               global_batch=cfg.train.micro_batch_size * cfg.train.micro_batches, n_ranks=n_ranks, schedule=name,
               gpus_per_node=gpus_per_node, work_dtype="float32" if precision == "fp32" else "bfloat16",
               optim_backend=cfg.optim.backend)


@dataclass
class Tuning:
    """One tuning: the profile (and whether it came from the cache), the search and its advice."""

    profile: MachineProfile
    reused: bool
    result: Result
    changes: list[Change]


def tune(job: Job, device: torch.device, *, adam_backend: str = "auto", refresh: bool = False,
         budget: Optional[dict[str, Optional[float]]] = None) -> Tuning:
    """Profile (cached), search, advise. ``budget`` bytes override what the profile found free
    (keys ``gpu``, ``host``, ``shm``; None keeps the measured figure)."""
    dtype = torch.float32 if job.work_dtype == "float32" else torch.bfloat16
    profile, reused = load_or_measure(job.model, job.seq_len, divisors(job.global_batch), dtype=dtype, device=device,
                                      refresh=refresh, adam_backend=adam_backend)
    given = budget or {}
    found = {"gpu": profile.hardware.device_free_bytes, "host": profile.host_available, "shm": profile.shm_free}
    limits = Budget(**{k: float(given[k] if given.get(k) is not None else v) for k, v in found.items()})
    result = search(job, limits, profile)
    return Tuning(profile, reused, result, advise(result, profile))


def choice(cand: Candidate) -> dict[str, Any]:
    """The config keys a candidate sets (``section.key``: value)."""
    o = cand.options
    return {"schedule.stages_per_rank": o.stages_per_rank, "schedule.split": o.split, "schedule.cfg": o.cfg,
            "schedule.param_buffers": o.param_buffers, "optim.workers": o.optimizer_workers,
            "train.micro_batch_size": cand.micro_batch_size, "train.micro_batches": cand.micro_batches}


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
        lines.append(f"closest: {closest.label()} (needs " + ", ".join(
            f"{r} {100 * v:.0f}%" for r, v in closest.over.items()) + " of the budget)")
    lines += [f"change: {ch.text}" for ch in tuning.changes] or ["no single change found: try a smaller model"]
    return "\n".join(lines)


def tuned_job_config(cfg: SysxConfig, info: Any, device: torch.device) -> SysxConfig:
    """``schedule.tune=true`` at job start: rank 0 profiles and searches, every rank takes its choice
    (all ranks must build the same schedule, and profiles measured on each would differ).

    ``info`` is the job's :class:`sysx.dist.DistInfo`. Raises :class:`ConfigError` with the closest
    candidate and the changes to make when nothing fits.
    """
    box: list[Any] = [None]
    if info.is_main:
        job = job_from_config(cfg, info.world_size, info.local_world_size, device)
        tuning = tune(job, device, adam_backend=cfg.optim.backend)
        best = tuning.result.best
        box[0] = choice(best) if best is not None else no_fit_message(tuning)
        how = "cached" if tuning.reused else f"measured in {tuning.profile.seconds:.1f} s"
        print("schedule.tune (profile " + how + "):\n  " + "\n  ".join(why(tuning.result, None)), flush=True)
    if info.world_size > 1:
        tdist.broadcast_object_list(box, src=0, group=sdist.cpu_group())
    if isinstance(box[0], str):
        raise ConfigError(box[0])
    return apply_choice(cfg, box[0])
