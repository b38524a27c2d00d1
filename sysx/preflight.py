"""``sysx-train --check``: what a job would refuse, found once before any rank starts.

The launch scripts run it before ``torchrun``/``mpiexec``: it composes and validates the
configuration, checks ``run_dir``, opens the data (its ids are sampled against the vocabulary) and
plans the layout and the host memory for ``--ranks`` processes on this node, without allocating,
creating ``run_dir`` or joining a process group. A problem is the same one line (exit 2) the job
itself would print, once instead of once per rank.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from sysx.config import ConfigError, SysxConfig, refuse_ignored_keys


def check_single(cfg: SysxConfig) -> str:
    """The sliding-window plan of ``schedule=single`` (hardware from ``single.hardware``); its summary line."""
    from sysx.checkpoint.pretrained import job_model_config
    from sysx.single.hardware import machine_hardware
    from sysx.single.plan_request import PlanError, plan_request_from_config
    from sysx.single.planner import make_plan
    from sysx.trainers.base import DTYPES, job_device, resolve_precision

    device = job_device(cfg)
    dtype = DTYPES[resolve_precision(cfg, device).precision]
    hw = machine_hardware(cfg.single.hardware, device, dtype)
    try:
        plan = make_plan(plan_request_from_config(cfg, cfg.single, job_model_config(cfg)), hw)
    except PlanError as err:
        raise ConfigError(f"schedule=single: {err}") from None
    return f"single: W={plan.window}/{plan.sizes.n_blocks} blocks, {plan.rounds} rounds x {plan.chunks} chunks"


def check_pipeline(cfg: SysxConfig, ranks: int) -> str:
    """The schedule of ``ranks`` processes on one node and its host memory plan, checked against this node."""
    from sysx.checkpoint.pretrained import job_model_config
    from sysx.dist import DistInfo
    from sysx.optim.rollback_choice import choose_rollback
    from sysx.runtime.options import make_schedule, options_from_config
    from sysx.runtime.stage_params import StageParams, _numel, layer_params, sub_stages
    from sysx.trainers.base import DTYPES, resolve_precision

    cfg = resolve_precision(cfg)
    opts = options_from_config(cfg)
    model_cfg, t = job_model_config(cfg), cfg.train
    schedule = make_schedule(opts, model_cfg, n_ranks=ranks, n_micro=t.micro_batches, seq_len=t.seq_len)
    numels = [sum(_numel(shape) for _, shape in entries) for entries in layer_params(model_cfg)]
    info = DistInfo(rank=0, world_size=ranks, local_rank=0, local_world_size=ranks)
    # StageParams.node_plan needs only these three fields: the plan every node leader checks at start
    view = SimpleNamespace(info=info, units=sub_stages(schedule, numels, info), dtype=DTYPES[cfg.precision])
    rollback, _ = choose_rollback(cfg.optim.rollback, lambda r: StageParams.node_plan(view, r))  # type: ignore[arg-type]
    plan = StageParams.node_plan(view, rollback)  # type: ignore[arg-type]
    return (
        f"{schedule.name}: {schedule.n_stages} stages on {ranks} rank(s), host memory {plan.total / 2**30:.2f} GiB, "
        f"optim.rollback={rollback}"
    )


def preflight(cfg: SysxConfig, ranks: int) -> str:
    """Every check of a job of ``ranks`` processes that needs no allocation; one summary line when all pass."""
    from sysx.checkpoint.pretrained import job_model_config
    from sysx.run_dir import check_run_dir
    from sysx.trainers.base import check_model_vocab, open_dataset

    if ranks < 1:
        raise ConfigError(f"--ranks {ranks} is not valid: must be an integer >= 1 (the processes the launcher starts)")
    check_run_dir(cfg.run_dir)
    name = cfg.schedule.name
    if name == "auto":
        name = "sysx" if ranks > 1 else "single"
        cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, name=name))
        refuse_ignored_keys(name, cfg.schedule, cfg.single)
    if name in ("reference", "single") and ranks > 1:
        raise ConfigError(
            f"schedule={name} runs in one process, not {ranks}; use schedule=sysx (or another pipeline) "
            "or launch one process"
        )
    dataset = open_dataset(cfg, announce=False)
    check_model_vocab(dataset, job_model_config(cfg))
    if name == "single":
        layout = check_single(cfg)
    elif name == "reference":
        layout = "reference: one process"
    else:
        layout = check_pipeline(cfg, ranks)
    return f"sysx-train --check: ok ({ranks} process{'es' if ranks > 1 else ''}; {layout}; data {len(dataset)} tokens)"
