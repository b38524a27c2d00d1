"""``sysx-train`` (also ``python -m sysx.train`` and ``sysx train``): the main training job.

    sysx-train [key=value | group=option ...] [--cfg job] [--help]

Overrides use Hydra's override grammar (``train.steps=50``, ``model=llama2_7b``), composed on
``conf/config.yaml`` with Hydra's compose API. The trainer for ``schedule.name`` is looked up in
:data:`TRAINERS`; a new schedule is one line there plus ``conf/schedule/<name>.yaml``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sysx.config import (
    ConfigError,
    SysxConfig,
    compose_config,
    config_dir,
    group_options,
    load_config,
    refuse_ignored_keys,
    to_yaml,
)
from sysx.config.choices import EMULATED_DEVICE
from sysx.rank_env import env_rank, env_world_size, launcher_env_problem, quiet_peer_warnings

if TYPE_CHECKING:
    from sysx.dist import DistInfo

PROG = "sysx-train"

# schedule name -> "module:function" with signature (cfg: SysxConfig, info: sysx.dist.DistInfo) -> int.
# Imported on use, so `sysx-train --help` stays fast and a schedule's dependencies load only when chosen.
TRAINERS: dict[str, str] = {
    "reference": "sysx.trainers.reference:train",
    "single": "sysx.trainers.single:train",
    "gpipe": "sysx.trainers.pipeline:train",
    "1f1b": "sysx.trainers.pipeline:train",
    "interleaved_1f1b": "sysx.trainers.pipeline:train",
    "mobius": "sysx.trainers.pipeline:train",
    "sysx": "sysx.trainers.pipeline:train",
    "auto": "sysx.train:train_auto",
}

# Arguments some launchers append (torch.distributed.launch's --local-rank); the rank is read from the environment.
_LAUNCHER_ARGS = ("--local-rank", "--local_rank")


@dataclass
class Invocation:
    """What the command line asked for."""

    overrides: list[str] = field(default_factory=list)
    help: bool = False
    show_cfg: bool = False
    check: bool = False  # --check: the pre-flight of the launch scripts (sysx.preflight)
    ranks: int = 1  # --ranks N: how many processes the pre-flight plans for
    multirun: bool = False  # -m/--multirun: one job per point of the sweeps in the overrides (sysx.sweep)


def parse_argv(argv: list[str]) -> Invocation:
    """Split argv into Hydra overrides and the few flags sysx-train has; unknown flags are an error."""
    inv = Invocation()
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            inv.help = True
        elif arg in ("--cfg", "-c") or arg.startswith("--cfg="):
            what = arg.split("=", 1)[1] if "=" in arg else (args.pop(0) if args else "")
            if what != "job":
                raise ConfigError(
                    f"--cfg {what or '(nothing)'} is not valid: allowed: --cfg job (print the composed config)"
                )
            inv.show_cfg = True
        elif arg == "--check":
            inv.check = True
        elif arg in ("-m", "--multirun"):
            inv.multirun = True
        elif arg == "--ranks" or arg.startswith("--ranks="):
            value = arg.split("=", 1)[1] if "=" in arg else (args.pop(0) if args else "")
            if not value.lstrip("-").isdigit():
                raise ConfigError(
                    f"--ranks {value or '(nothing)'} is not valid: must be an integer >= 1, e.g. --ranks 2"
                )
            inv.ranks = int(value)
        elif arg.startswith(_LAUNCHER_ARGS):
            if "=" not in arg and args and args[0].isdigit():
                args.pop(0)
        elif arg.startswith("-") and not arg.startswith("~"):
            raise ConfigError(
                f"unknown option {arg!r}; {PROG} takes key=value overrides, -m (a sweep), --cfg job, --check [--ranks N] "
                "and --help"
            )
        else:
            inv.overrides.append(arg)
    return inv


def help_text(overrides: list[str]) -> str:
    """``--help``: usage, the config groups and their options, and the composed configuration."""
    from omegaconf import OmegaConf

    from sysx.config.describe import describe_keys

    groups = "\n".join(f"  {g:<9} {', '.join(group_options(g))}" for g in ("model", "schedule", "optim", "data"))
    cfg = compose_config(overrides)
    return (
        f"usage: {PROG} [-m] [key=value | group=option ...] [--cfg job] [--check [--ranks N]] [--help]\n\n"
        f"Train a Llama model. Configuration: {config_dir()}/config.yaml, overridden by Hydra-style arguments, e.g.\n"
        f"  {PROG} train.steps=50 precision=bf16 run_dir=/tmp/run\n"
        f"  {PROG} model=llama2_7b data=file data.path=/data/tokens.bin\n\n"
        f"config groups (group=option):\n{groups}\n\n"
        f"flags:\n  -m          a sweep (--multirun): one job per point of a,b / range(...) values, in run_dir/<n>\n"
        f"  --cfg job   print the composed configuration and exit\n"
        f"  --check     check the configuration, run_dir, data and memory plan for --ranks N processes "
        f"(default 1) without allocating; exit 2 with one line if the job would fail\n  --help      this text\n\n"
        f"configuration (key=value as composed now, and what it is; every key can be overridden):\n"
        f"{describe_keys(OmegaConf.to_container(cfg))}"
    )


def trainer_for(name: str) -> Callable[..., int]:
    """The job function of ``schedule.name``; an unknown name is a :class:`ConfigError`."""
    if name not in TRAINERS:
        raise ConfigError(f"schedule.name={name} is not valid: allowed: {', '.join(sorted(TRAINERS))}")
    module, _, func = TRAINERS[name].partition(":")
    return getattr(importlib.import_module(module), func)


def train_auto(cfg: SysxConfig, info: DistInfo) -> int:
    """``schedule=auto``: the SysX pipeline for several processes (and on an emulated device), the
    single-device sliding window for one. The resolved name replaces ``auto`` in the config, so ``config.yaml`` and the logs say
    what ran."""
    name = "sysx" if info.world_size > 1 or cfg.device == EMULATED_DEVICE else "single"
    if info.is_main:
        print(
            f"sysx-train: schedule=auto -> {name} ({info.world_size} process{'es' if info.world_size > 1 else ''})",
            flush=True,
        )
    # several processes tune their layout unless told not to, or given one by hand
    s = cfg.schedule
    by_hand = s.stage_sizes is not None or s.stages_per_rank is not None or s.split is not None
    tune = s.tune if s.tune is not None or name != "sysx" else info.world_size > 1 and not by_hand
    cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, name=name, tune=tune))
    refuse_ignored_keys(name, cfg.schedule, cfg.single)
    return trainer_for(name)(cfg, info)


def run(cfg: SysxConfig) -> int:
    """Run the job described by a validated configuration on this process's rank."""
    from sysx import stopping
    from sysx.dist import detect

    job = trainer_for(cfg.schedule.name)
    stopping.install()  # SIGINT/SIGTERM -> JobStopped: every rank unwinds, closes and exits 130/143
    return int(job(cfg, detect()) or 0)


def one_line(err: BaseException) -> str:
    """A possibly multi-line message as one line: its text before any attached plan, lines joined."""
    text = str(err).split("\n\nPlan:", 1)[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(err).__name__


def check(inv: Invocation, cfg: SysxConfig) -> int:
    """``--check``: the pre-flight (:mod:`sysx.preflight`); prints its summary, returns 0."""
    from sysx.preflight import preflight

    summary = preflight(cfg, inv.ranks)
    if env_rank() == 0:
        print(summary, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sysx-train``: parse, compose, validate, dispatch. Returns the exit status."""
    quiet_peer_warnings()  # before torch is imported
    from sysx.checkpoint.store import CheckpointError
    from sysx.data.errors import DataError
    from sysx.memory.budget import HostMemoryError
    from sysx.optim.loss_scaler import LossScaleTooSmall, NonFiniteGradients
    from sysx.rendezvous import RendezvousTimeout
    from sysx.stopping import JobStopped

    args = list(sys.argv[1:] if argv is None else argv)
    problem = launcher_env_problem()
    if problem is not None:  # said by every process it concerns: its rank may not be 0
        print(f"{PROG}: error: {problem}", file=sys.stderr, flush=True)
        return 2
    is_main = env_rank() == 0
    run_dir: str | None = None
    try:
        inv = parse_argv(args)
        if inv.help:
            if is_main:
                print(help_text(inv.overrides))
            return 0
        if inv.multirun:
            return sweep(inv)
        cfg = load_config(inv.overrides)
        if cfg.model.init_from is not None:  # the weights' shape, checked before anything starts
            from sysx.checkpoint.pretrained import job_model_config

            job_model_config(cfg)
        run_dir = cfg.run_dir
        trainer_for(cfg.schedule.name)
        if inv.show_cfg:
            if is_main:
                print(to_yaml(cfg), end="")
            return 0
        from sysx.preflight import check_inputs

        check_inputs(cfg, inv.ranks if inv.check else env_world_size())
        if inv.check:
            return check(inv, cfg)
        from sysx.run_dir import check_run_dir

        check_run_dir(cfg.run_dir)  # before the trainer allocates anything
        return exit_status(run(cfg))
    except (ConfigError, DataError) as err:
        if is_main:  # every rank composes the same config and data: rank 0 speaks for all
            print(f"{PROG}: error: {one_line(err)}", file=sys.stderr, flush=True)
        return 2
    except (HostMemoryError, CheckpointError, RendezvousTimeout) as err:
        # found by one rank: the node's planner, the reader of a damaged file, a rank whose peers never came
        print(f"{PROG}: error: {one_line(err)}", file=sys.stderr, flush=True)
        return exit_status(2)
    except (LossScaleTooSmall, NonFiniteGradients) as err:
        print(f"{PROG}: training stopped (rank {env_rank()}): {err}", file=sys.stderr, flush=True)
        return 1
    except JobStopped as stop:
        if is_main:  # one line for the job; the other ranks stop silently
            print(f"{PROG}: {stop}{stop.where}", file=sys.stderr, flush=True)
        return exit_status(stop.exit_code)
    except KeyboardInterrupt:  # Ctrl-C before the job's own handlers were installed
        if is_main:
            print(f"{PROG}: stopped by SIGINT", file=sys.stderr, flush=True)
        return 130
    except Exception as err:
        if env_world_size() == 1:
            raise  # one process: its traceback is the report
        return rank_failed(err, run_dir)


def sweep(inv: Invocation) -> int:
    """``-m``: every point of the overrides' sweeps as its own job (:mod:`sysx.sweep`), with the same flags."""
    from sysx.config.overrides import sweep_points
    from sysx.sweep import run_sweep

    flags = (["--check", "--ranks", str(inv.ranks)] if inv.check else []) + (["--cfg", "job"] if inv.show_cfg else [])
    return run_sweep(sweep_points(inv.overrides), flags)


def rank_failed(err: Exception, run_dir: str | None) -> int:
    """A rank of a multi-process job failed with an unexpected error: one line (every rank's traceback
    on one terminal would bury the cause), the traceback into ``run_dir`` when it exists. Returns 1."""
    import traceback

    rank, text = env_rank(), "".join(traceback.format_exception(err))
    saved = Path(run_dir) / f"traceback-rank{rank}.txt" if run_dir is not None and Path(run_dir).is_dir() else None
    try:
        if saved is not None:
            saved.write_text(text)
    except OSError:
        saved = None
    where = f"traceback in {saved}" if saved is not None else "traceback below"
    print(f"{PROG}: rank {rank}: error: {type(err).__name__}: {one_line(err)} ({where})", file=sys.stderr, flush=True)
    if saved is None:
        print(text, file=sys.stderr, end="", flush=True)
    return exit_status(1)


def exit_status(code: int) -> int:
    """``code``, or the end of the process right here when a stopped or failed multi-process job
    left a wait blocked inside gloo or the process group's creation (interpreter teardown would abort under it): the exit
    handlers (shared-memory cleanup) run first, then ``os._exit``."""
    dist_module, rendezvous = sys.modules.get("sysx.dist"), sys.modules.get("sysx.rendezvous")
    if (dist_module is not None and dist_module.abandoned_wait()) or (
        rendezvous is not None and rendezvous.abandoned()
    ):
        import atexit

        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
