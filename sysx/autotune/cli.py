"""``sysx tune``: profile this machine for the job's model, simulate every configuration of the
job's pipeline schedule with the profiled costs, and print the best that fit the memory budgets.

    sysx tune --ranks 4 --hydra model=tiny train.seq_len=256 train.micro_batch_size=4 train.micro_batches=4

The job config is composed from ``conf/`` like ``sysx-train`` (and ``sysx plan --hydra``) does;
the global batch (``train.micro_batch_size x train.micro_batches``) is kept, every split of it
into micro-batches is tried. The profile is cached per machine and model shape
(``$SYSX_CACHE_DIR/autotune``; ``--refresh`` measures again). Budgets default to what the
profile found free (GPU memory; on CPU the host's; available RAM; free ``/dev/shm``). With
``device=emulated`` nothing is measured: the profile is the emulated cluster's (``emulate.*``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from sysx import device as dev
from sysx.autotune.apply import job_from_config, job_profile, tune
from sysx.autotune.profile import MachineProfile
from sysx.autotune.report import as_dict, table, why
from sysx.autotune.search import Budget, Candidate, Job, Result, Space, evaluate, thread_options
from sysx.config import ConfigError, SysxConfig, load_config
from sysx.config.choices import EMULATED_DEVICE
from sysx.partition import PartitionError
from sysx.runtime.options import options_from_config
from sysx.schedule.ops import ScheduleError

GiB = float(1 << 30)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sysx tune", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hydra", nargs="*", metavar="KEY=VALUE", default=[], help="overrides of the job config (conf/)")
    p.add_argument("--ranks", "-g", type=int, default=4, help="pipeline ranks (processes) of the job, default 4")
    p.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (default all on one node)")
    p.add_argument(
        "--gpu-memory-gib", type=float, default=None, help="GPU budget per GPU (default: free on this device)"
    )
    p.add_argument("--host-memory-gib", type=float, default=None, help="host budget per node (default: available RAM)")
    p.add_argument("--shm-gib", type=float, default=None, help="/dev/shm budget per node (default: free)")
    p.add_argument("--top", type=int, default=5, help="candidates to print")
    p.add_argument("--refresh", action="store_true", help="measure the profile again even if one is cached")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _baseline(cfg: SysxConfig, job: Job, budget: Budget, profile: MachineProfile) -> Candidate | str:
    """Today's fixed rule (:func:`make_schedule` with the config's options and micro-batches)."""
    workers, threads = thread_options(job, profile, Space())[0]
    try:
        opts = options_from_config(cfg, schedule=job.schedule)
        workers = opts.optimizer_workers or workers
        return evaluate(job, budget, profile, opts, cfg.train.micro_batch_size, workers, threads)
    except (ScheduleError, PartitionError, ConfigError) as err:
        return str(err)


def _print(
    result: Result, profile: MachineProfile, reused: bool, baseline: Candidate | str, changes: list, top: int
) -> None:
    b = result.budget
    how = (
        "the emulated device's"
        if profile.hardware.kind == "emulated"
        else ("cached" if reused else f"measured in {profile.seconds:.1f} s")
    )
    print(
        f"profile ({how}): {profile.hardware.describe()}; CPU Adam {profile.adam_params_per_s / 1e6:.0f} M params/s "
        f"per thread, {profile.cpu_threads} threads"
    )
    print(
        f"budget: GPU {b.gpu / GiB:.2f} GiB per GPU, host {b.host / GiB:.2f} GiB and /dev/shm {b.shm / GiB:.2f} GiB "
        f"per node; {result.job.n_ranks} ranks, global batch {result.job.global_batch} x {result.job.seq_len} tokens"
    )
    print()
    if result.fitting:
        print(table(result.fitting, top))
    elif result.closest is not None:
        print("nothing fits; the closest candidate:")
        print(table([result.closest], 1))
    print()
    for line in why(result, baseline):
        print(line)
    for ch in changes:
        print(f"change: {ch.text}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sysx tune``."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = load_config(args.hydra)
        # the emulated device is played on this CPU and answers with its own profile
        device = dev.default_device() if cfg.device in ("auto", EMULATED_DEVICE) else torch.device(cfg.device)
        job = job_from_config(cfg, args.ranks, args.gpus_per_node, device)
    except ValueError as err:  # ConfigError and unknown presets
        print(f"sysx tune: {err}", file=sys.stderr)
        return 2
    given = {"gpu": args.gpu_memory_gib, "host": args.host_memory_gib, "shm": args.shm_gib}
    tuning = tune(
        job,
        device,
        adam_backend=cfg.optim.backend,
        refresh=args.refresh,
        profile=job_profile(cfg, job),
        budget={k: None if v is None else v * GiB for k, v in given.items()},
    )
    profile, reused, result, changes = tuning.profile, tuning.reused, tuning.result, tuning.changes
    baseline = _baseline(cfg, job, result.budget, profile)
    if args.json:
        print(json.dumps(dict(as_dict(result, changes, baseline, args.top), profile_reused=reused)))
    else:
        _print(result, profile, reused, baseline, changes, args.top)
    return 0
