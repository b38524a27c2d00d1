"""``sysx-train --check``: what a job would refuse, found once before any rank starts.

The launch scripts run it before ``torchrun``/``mpiexec``: it composes and validates the
configuration, checks ``run_dir``, opens the data (its ids are sampled against the vocabulary) and
plans the layout and the host memory for ``--ranks`` processes on this node, without allocating,
creating ``run_dir`` or joining a process group. A problem is the same one line (exit 2) the job
itself would print, once instead of once per rank.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

from sysx.config import ConfigError, SysxConfig, refuse_ignored_keys
from sysx.config.choices import EMULATED_DEVICE
from sysx.memory.budget import HostMemoryError, HostMemoryPlan, fmt_bytes


def check_single(cfg: SysxConfig) -> str:
    """The sliding-window plan of ``schedule=single`` (hardware from ``single.hardware``); its summary line."""
    from sysx.checkpoint.pretrained import job_model_config
    from sysx.memory.budget import plan_host_memory
    from sysx.single.hardware import machine_hardware
    from sysx.single.plan_request import PlanError, plan_request_from_config
    from sysx.single.planner import make_plan
    from sysx.trainers.base import DTYPES, job_device, resolve_precision

    device = job_device(cfg)
    cfg = resolve_precision(cfg, device)  # the plan is made for the precision the job will train in
    hw = machine_hardware(cfg.single.hardware, device, DTYPES[cfg.precision])
    try:
        plan = make_plan(plan_request_from_config(cfg, cfg.single, job_model_config(cfg)), hw)
    except PlanError as err:
        raise ConfigError(f"schedule=single: {err}") from None
    state = [(plan.sizes.total_params, DTYPES[cfg.precision])]
    tier = plan_host_memory(state, rollback=cfg.optim.rollback, offload="nvme")
    files = check_state_files(cfg, tier.disk, tier.step_io)
    return f"single: W={plan.window}/{plan.sizes.n_blocks} blocks, {plan.rounds} rounds x {plan.chunks} chunks{files}"


def check_pipeline(cfg: SysxConfig, ranks: int) -> str:
    """The schedule of ``ranks`` processes on one node (``parallel.replicas`` pipelines of ``ranks / R``
    ranks each) and its host memory plan, checked against this node. A world size that is not a
    multiple of the replicas is the one-line :class:`ConfigError` of :meth:`ReplicaLayout.of`."""
    from sysx.checkpoint.pretrained import job_model_config
    from sysx.dist import DistInfo
    from sysx.optim.rollback_choice import choose_rollback, tier_disk_free
    from sysx.replicas import ReplicaLayout
    from sysx.runtime.options import make_schedule, options_from_config
    from sysx.runtime.stage_params import StageParams, _numel, layer_params, sub_stages
    from sysx.trainers.base import DTYPES, resolve_precision

    try:
        layout = ReplicaLayout.of(cfg.parallel.count, ranks, local_world_size=ranks)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    cfg = resolve_precision(cfg)
    opts = options_from_config(cfg)
    model_cfg, t = job_model_config(cfg), cfg.train
    schedule = make_schedule(
        opts,
        model_cfg,
        n_ranks=layout.pipeline,
        n_micro=t.micro_batches,
        seq_len=t.seq_len,
        micro_batch_size=t.micro_batch_size,
        spread_allowed=layout.replicas == 1 and cfg.optim.offload == "host",
    )
    numels = [sum(_numel(shape) for _, shape in entries) for entries in layer_params(model_cfg)]
    info = DistInfo(rank=0, world_size=ranks, local_rank=0, local_world_size=ranks)
    # StageParams.node_plan needs only these four fields: the plan every node leader checks at start
    units = sub_stages(schedule, numels, info, layout)
    view = SimpleNamespace(info=info, units=units, dtype=DTYPES[cfg.precision], replica_layout=layout)

    def plan_of(rollback: str, offload: str = cfg.optim.offload) -> HostMemoryPlan:
        return StageParams.node_plan(view, rollback, offload)  # type: ignore[arg-type]

    try:
        rollback, _ = choose_rollback(
            cfg.optim.rollback, plan_of, disk_free=tier_disk_free(cfg.optim.offload, cfg.optim.nvme_dir)
        )
    except HostMemoryError as err:
        raise HostMemoryError(_with_tier_hint(str(err), cfg, plan_of("undo", "nvme"))) from None
    plan = plan_of(rollback)
    files = check_state_files(cfg, plan.disk, plan.step_io)
    replicas = f" x {layout.replicas} replicas" if layout.replicas > 1 else ""
    return (
        f"{schedule.name}: {schedule.n_stages} stages on {layout.pipeline} rank(s){replicas}, "
        f"host memory {plan.total / 2**30:.2f} GiB{files}, optim.rollback={rollback}"
    )


def _with_tier_hint(message: str, cfg: SysxConfig, tier: HostMemoryPlan) -> str:
    """``message`` (a host-memory refusal) with what the NVMe tier would need, when it is not on yet."""
    if cfg.optim.offload == "nvme":
        return message
    head, sep, plan = message.partition("\n\nPlan:")
    return (
        f"{head}\n  Or keep the optimizer state on disk: optim.offload=nvme optim.nvme_dir=<a directory on a "
        f"local NVMe drive> needs {fmt_bytes(tier.total)} of host memory and {fmt_bytes(tier.disk)} of disk "
        f"on this node.{sep}{plan}"
    )


def check_state_files(cfg: SysxConfig, disk_bytes: int, step_bytes: int = 0) -> str:
    """With ``optim.offload=nvme``: a one-line :class:`ConfigError` when ``optim.nvme_dir`` is missing or
    has less free space than the ``disk_bytes`` of state files; else a summary fragment ("" without the
    tier) with the disk time of ``step_bytes`` read and written per step at the drive's cached rates."""
    from sysx.machine.disk_cache import cached_disk, free_disk_bytes
    from sysx.optim.nvme.cost import disk_shortage

    if cfg.optim.offload != "nvme":
        return ""
    directory = str(cfg.optim.nvme_dir)
    if not os.path.isdir(directory):
        raise ConfigError(
            f"optim.nvme_dir={directory} is not a directory; create it on a local NVMe drive (mkdir -p {directory})"
        )
    free = free_disk_bytes(directory)
    problem = disk_shortage(disk_bytes, free, directory)
    if problem:
        raise ConfigError(problem)
    rates = cached_disk(directory, cfg.optim.nvme_engine)  # never measured here: the check stays fast
    busy = (
        ""
        if rates is None
        else f" (disk {rates.io_seconds(step_bytes, step_bytes):.3g} s per step at {rates.describe()})"
    )
    return f", state files {fmt_bytes(disk_bytes)} of {fmt_bytes(free)} free in {directory}{busy}"


def check_inputs(cfg: SysxConfig, ranks: int) -> None:
    """What every run checks before it starts (the job and ``--check``) and before it allocates: the
    checkpoint ``train.resume`` names, and the host memory of the token ids sampled at once."""
    from sysx.checkpoint.reader import RESUME_CHOICES, find_resume
    from sysx.checkpoint.store import CheckpointError

    if cfg.train.resume not in RESUME_CHOICES:
        try:
            find_resume(cfg.train.resume, cfg.checkpoint_dir)
        except CheckpointError as err:
            raise ConfigError(str(err)) from None
    check_batch_fits(cfg, _schedule_name(cfg, ranks))


def check_batch_fits(cfg: SysxConfig, schedule: str) -> None:
    """The token ids a process samples at once (one micro-batch; the whole step for ``schedule=single``,
    which cuts it into its own chunks) must fit in the host memory available now: the least a step
    needs, whatever else it plans."""
    from sysx.data.sampler import batch_host_bytes
    from sysx.memory.budget import cgroup_memory, fmt_bytes, ram_available_bytes

    t = cfg.train
    at_once = t.micro_batches if schedule == "single" else 1  # micro-batches sampled together
    need = batch_host_bytes(t.micro_batch_size * at_once, t.seq_len)
    cgroup = cgroup_memory()
    available = ram_available_bytes() if cgroup is None else min(ram_available_bytes(), cgroup.available)
    if need <= available:
        return
    fits = available // batch_host_bytes(at_once, t.seq_len)
    what = f"{t.micro_batch_size} x {t.micro_batches} micro-batches (schedule=single samples a whole step)"
    raise ConfigError(
        f"train.micro_batch_size={t.micro_batch_size} cannot fit: the token ids of "
        f"{what if at_once > 1 else t.micro_batch_size} sequences of {t.seq_len} tokens need {fmt_bytes(need)} "
        f"of host memory and this machine has {fmt_bytes(available)} available; set train.micro_batch_size <= {fits}"
    )


def _schedule_name(cfg: SysxConfig, ranks: int) -> str:
    """``schedule.name`` with ``auto`` resolved for ``ranks`` processes (as :func:`sysx.train.train_auto` does)."""
    if cfg.schedule.name != "auto":
        return cfg.schedule.name
    return "sysx" if ranks > 1 or cfg.device == EMULATED_DEVICE else "single"


def preflight(cfg: SysxConfig, ranks: int) -> str:
    """Every check of a job of ``ranks`` processes that needs no allocation; one summary line when all pass."""
    from sysx.checkpoint.pretrained import check_data_tokenizer, job_model_config
    from sysx.run_dir import check_run_dir
    from sysx.trainers.base import check_model_vocab, open_dataset

    if ranks < 1:
        raise ConfigError(f"--ranks {ranks} is not valid: must be an integer >= 1 (the processes the launcher starts)")
    check_run_dir(cfg.run_dir)
    name = _schedule_name(cfg, ranks)
    if cfg.schedule.name == "auto":
        cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, name=name))
        refuse_ignored_keys(name, cfg.schedule, cfg.single)
    if name in ("reference", "single") and ranks > 1:
        raise ConfigError(
            f"schedule={name} runs in one process, not {ranks}; use schedule=sysx (or another pipeline) "
            "or launch one process"
        )
    dataset = open_dataset(cfg, announce=False)
    check_model_vocab(dataset, job_model_config(cfg))
    check_data_tokenizer(cfg, dataset)
    if name == "single":
        layout = check_single(cfg)
    elif name == "reference":
        layout = "reference: one process"
    else:
        layout = check_pipeline(cfg, ranks)
    return f"sysx-train --check: ok ({ranks} process{'es' if ranks > 1 else ''}; {layout}; data {len(dataset)} tokens)"
