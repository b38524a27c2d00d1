"""Pipeline schedules as data: ops, builders, validator, simulator, pictures.

``build(name, n_ranks, n_micro, ...)`` returns a :class:`Schedule` for any of
``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``mobius``, ``sysx``; :func:`evaluation_schedule` its
forward-only program; :func:`validate` proves either executable, :func:`simulate` turns it plus
costs into a :class:`Timeline`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sysx.config.choices import ONE_STAGE_PER_RANK, PIPELINE_SCHEDULES
from sysx.partition import Partition, PartitionError, uniform_partition
from sysx.schedule.costs import Costs, CostTable, UnitCosts, costs_from_model
from sysx.schedule.evaluation import evaluation_schedule
from sysx.schedule.gpipe import build_gpipe
from sysx.schedule.interleaved import build_interleaved_1f1b
from sysx.schedule.mobius import build_mobius
from sysx.schedule.one_f_one_b import build_1f1b
from sysx.schedule.ops import CkptRoute, Message, Op, OpKind, Schedule, ScheduleError, ScheduleOptions
from sysx.schedule.posted import post_receives
from sysx.schedule.simulate import Event, Timeline, simulate
from sysx.schedule.sysx import CFG_FEATURES, build_sysx
from sysx.schedule.validate import validate

SCHEDULES = PIPELINE_SCHEDULES


def build(
    name: str,
    n_ranks: int,
    n_micro: int,
    partition: Partition | None = None,
    *,
    n_stages: int | None = None,
    split: int = 1,
    cfg: int = 3,
    param_buffers: int = 2,
    keep_activations: bool = False,
    head_igrad: frozenset[int] = frozenset(),
    backward_parts: int = 1,
) -> Schedule:
    """Build schedule ``name``. Without ``partition``, a uniform one with ``n_stages`` stages
    (default: ``Ng`` for gpipe/1f1b, ``2 Ng`` otherwise) and ``split`` (sysx only).
    ``keep_activations``, ``head_igrad``, ``backward_parts``: see :class:`ScheduleOptions` (the
    first not for sysx, the others sysx only).

    Every call builds a new schedule (milliseconds even for thousands of ops; a caller that
    builds the same one repeatedly keeps it).
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    if partition is None:
        nsf = n_stages if n_stages is not None else (n_ranks if name in ONE_STAGE_PER_RANK else 2 * n_ranks)
        if not isinstance(nsf, int) or nsf < 1:
            raise PartitionError(f"n_stages={nsf!r} must be a positive int")
        partition = uniform_partition(nsf, split if name == "sysx" else 1)
    elif name != "sysx" and partition.split != 1:
        partition = partition.with_split(1)
    kw: dict[str, Any] = {"param_buffers": param_buffers}
    if head_igrad and name != "sysx":
        raise ScheduleError(f"head_igrad moves SysX's Head input gradient to its forward; {name} has none to move")
    if backward_parts != 1 and name != "sysx":
        raise ScheduleError(f"backward_parts={backward_parts!r} splits SysX's backward sub-stages; {name} has none")
    if name == "gpipe":
        built = build_gpipe(n_ranks, n_micro, partition, **kw)
    elif name == "1f1b":
        built = build_1f1b(n_ranks, n_micro, partition, **kw)
    elif name == "interleaved_1f1b":
        built = build_interleaved_1f1b(n_ranks, n_micro, partition, **kw)
    elif name == "mobius":
        built = build_mobius(n_ranks, n_micro, partition, **kw)
    else:
        built = build_sysx(
            n_ranks, n_micro, partition, cfg=cfg, head_igrad=head_igrad, backward_parts=backward_parts, **kw
        )
    if not keep_activations:
        return built
    if name == "sysx":
        raise ScheduleError(
            "keep_activations: sysx runs backward sub-stages from sent checkpoints; use another schedule"
        )
    return dataclasses.replace(built, options=dataclasses.replace(built.options, keep_activations=True))


def validate_first(schedule: Schedule) -> Schedule:
    """The program a step that validates before it steps runs (:mod:`sysx.optim.speculate`):
    ``schedule`` with a synchronous CPU optimizer (every sub-stage steps after VALIDATE), i.e. SysX
    CFG3 lowered as CFG2, with the posted receives when ``schedule`` has them (the runtime's
    schedules do: without them the plan of a validating-first 10B step read 5% long). A schedule
    whose optimizer is synchronous already is its own."""
    if schedule.options.optimizer != "async":
        return schedule
    if schedule.name != "sysx":
        raise ScheduleError(f"{schedule.name} has an asynchronous optimizer but no synchronous variant")
    opts = schedule.options
    synchronous = build_sysx(
        schedule.n_ranks,
        schedule.n_micro,
        schedule.partition,
        cfg=2,
        param_buffers=opts.param_buffers,
        backward_parts=opts.backward_parts,
    )
    # the lowering gives back as itself a schedule it has nothing to do on: one lowered already (or
    # one without transfers, whose synchronous program has none either)
    return post_receives(synchronous) if post_receives(schedule) is schedule else synchronous


__all__ = [
    "CFG_FEATURES",
    "SCHEDULES",
    "CkptRoute",
    "CostTable",
    "Costs",
    "Event",
    "Message",
    "Op",
    "OpKind",
    "Partition",
    "PartitionError",
    "Schedule",
    "ScheduleError",
    "ScheduleOptions",
    "Timeline",
    "UnitCosts",
    "build",
    "build_1f1b",
    "build_gpipe",
    "build_interleaved_1f1b",
    "build_mobius",
    "build_sysx",
    "costs_from_model",
    "evaluation_schedule",
    "simulate",
    "validate",
    "validate_first",
]
