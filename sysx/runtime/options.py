"""What the multi-process runtime needs besides :class:`sysx.config.SysxConfig`, and the schedule it runs.

:class:`PipelineOptions` gathers the ``schedule.*`` settings (which schedule, and the keys the
pipeline schedules read, :class:`sysx.config.sections.PipelineKeys`: stages per rank, the SysX
split ``d`` and ablation ``cfg``, GPU parameter buffers, a manual partition, p2p verification,
timeout) and a few runtime knobs (CPU Adam backend, rollback mode, workers, job id).
:func:`options_from_config` reads them from ``cfg.schedule`` and ``cfg.optim``; built directly,
they are the library API, checked by the same code as the config.

:func:`make_schedule` turns them into the validated :class:`sysx.schedule.Schedule` every rank
builds identically (pure data, no communication): the model's layers are cut by forward FLOPs
(:func:`sysx.partition.partition_model`) unless ``stage_sizes`` gives the layer counts.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sysx.config import ConfigError, ScheduleSection, SysxConfig, refuse_ignored_keys
from sysx.config.choices import ONE_STAGE_PER_RANK, PIPELINE_SCHEDULES
from sysx.config.sections import PipelineKeys, check_host_adam
from sysx.partition import Partition, PartitionError, partition_model
from sysx.schedule import Schedule, build, validate
from sysx.schedule.posted import post_receives
from sysx.schedule.spread import spread_over_node

if TYPE_CHECKING:
    from sysx.model import ModelConfig


class RuntimeConfigError(ConfigError):
    """A runtime option that cannot work (the message names the key, the value and the fix)."""


# SysX cuts each forward stage into sub-stages as long as a forward pass (paper §3.1): a backward
# with recomputation is a forward plus twice one, so d = 3. The paper's evaluated runs use it (its
# artifact appendix: "two forward stages which are further partitioned into six backward stages");
# its Figure 8 draws d = 2 for a backward without recomputation. Only with asynchronous checkpoints
# (CFG2, CFG3): sent synchronously (CFG1), the extra checkpoint messages of d = 3 tie the ranks'
# timelines together (emulated 10B, 2048 tokens: 19.6 s per iteration against 13.5 s at d = 2).
BALANCED_SPLIT = 3

# SysX's default layout (CFG2, CFG3, when neither stages_per_rank, split nor stage_sizes is set): one
# Block per forward stage (Nsf = L + 1: the Embedding rides with the first Block, the Head runs alone)
# and d = 1, the backward sub-stage being the forward stage. The pipeline fill takes Ng - 1 forward
# passes of one unit and the drain of the last backward round Ng - 1 backward passes of one, so the
# finest units shorten both: the fill to a third of 4 stages per rank with d = 3 (3-Block stages,
# 1-Block sub-stages), the drain as short. The Head alone is the first backward sub-stage, and with
# Nsf = L + 1 not a multiple of Ng (usually) the backward ring (:func:`sysx.partition.sysx_bwd_rank`)
# gives that rank the last sub-stage too, so the rank with the most work is the one no drain follows.
# Every unit is still loaded once per pass over it (the same host-to-device bytes) and a rank holds
# one checkpoint per owned sub-stage and micro-batch, as with 1-Block sub-stages; what grows is the
# number of forward stages, so of instructions and activation messages. Emulated V100 cluster, the
# paper's Fig. 9 grid: 2.3-3.4% shorter iterations than 4 stages per rank with d = 3 (issue 27,
# profiling/RESULTS.md, "Twelfth session").
BLOCK_STAGES_SPLIT = 1
# ... where its units are many: at least 12 flat layers per rank, where the previous default (4 stages
# per rank of d = 3) applied. On fewer, a step has few units and the per-instruction host work of the
# extra forward stages shows (CPU, tiny on 2 ranks: the sysx checkpoint tests 63 -> 81 s); those
# models keep 2 stages per rank.
BLOCK_STAGES_MIN_LAYERS_PER_RANK = 12


def block_stages(n_flat_layers: int) -> int:
    """Forward stages of the one-Block-per-stage layout of a model of ``n_flat_layers`` flat layers
    (Embedding, L Blocks, Head): ``L + 1``; the balanced cut then joins the Embedding to the first
    Block (it costs nothing) and leaves the Head alone."""
    return n_flat_layers - 1


@dataclass
class PipelineOptions(PipelineKeys):
    """Settings of one pipeline run: the pipeline schedule, its ``schedule.*`` keys
    (:class:`~sysx.config.sections.PipelineKeys`, with the config's defaults) and runtime knobs.

    ``stages_per_rank`` and ``split`` left ``None`` are chosen: one Block per forward stage and
    ``d = 1`` for CFG2-3 with 12 flat layers a rank (:func:`block_stages`), else 2 stages per rank (the paper's evaluated
    setting; ``d = 2`` for CFG1), else fewer (see :meth:`candidates` and :func:`make_schedule`). ``optim_backend``, ``rollback``,
    ``optimizer_workers``: the host CPU Adam's ``optim.backend``, ``optim.rollback``, ``optim.workers``.
    """

    schedule: str = "sysx"
    optim_backend: str = "auto"
    rollback: str = "undo"
    optimizer_workers: int | None = None
    job_id: str | None = None

    def schedule_section(self) -> ScheduleSection:
        """The ``schedule.*`` section of the job config these options stand for."""
        return ScheduleSection(name=self.schedule, **_keys(self))

    def check(self) -> None:
        """Raise :class:`RuntimeConfigError` naming the first bad option. The checks are the job
        config's (one definition of each range and choice), also refusing a key this schedule ignores."""
        if self.schedule not in PIPELINE_SCHEDULES:
            raise RuntimeConfigError(
                f"schedule.name={self.schedule} is not a pipeline schedule; allowed: {', '.join(PIPELINE_SCHEDULES)}"
            )
        section = self.schedule_section()
        try:
            section.validate()
            check_host_adam(self.optim_backend, self.rollback, self.optimizer_workers)
            refuse_ignored_keys(self.schedule, section)
        except ConfigError as err:
            raise RuntimeConfigError(str(err)) from None

    def candidates(self, n_ranks: int, n_flat_layers: int | None = None) -> list[tuple[int, int]]:
        """``(Nsf, d)`` to try, preferred first: the given values (``stage_sizes`` names the stages),
        else (CFG2-3, a model of ``n_flat_layers`` given, at least ``BLOCK_STAGES_MIN_LAYERS_PER_RANK``
        a rank) one Block per stage (:func:`block_stages`, ``d = 1``), then 2 stages per rank with
        ``d = BALANCED_SPLIT``, then 2 then 1 stage(s) per rank with ``d`` 2 then 1 (sysx CFG1-3
        only; other schedules and CFG0 run whole-stage backwards)."""
        if self.schedule in ONE_STAGE_PER_RANK:
            stages = [n_ranks]
        elif self.stages_per_rank is not None:
            stages = [self.stages_per_rank * n_ranks]
        elif self.stage_sizes is not None:
            stages = [len(self.stage_sizes)]
        else:
            stages = [2 * n_ranks, n_ranks]
        if self.schedule == "sysx" and self.cfg > 0:
            splits = [self.split] if self.split is not None else [2, 1]
        else:
            splits = [1]
        found = [(nsf, d) for d in splits for nsf in stages]
        if self.schedule == "sysx" and self.cfg >= 2 and self.split is None:
            found.insert(0, (stages[0], BALANCED_SPLIT))
            if self.stages_per_rank is None and self.stage_sizes is None and fits_block_stages(n_flat_layers, n_ranks):
                found.insert(0, (block_stages(n_flat_layers or 0), BLOCK_STAGES_SPLIT))
        return found

    def spreads(self, allowed: bool = True) -> bool:
        """Whether the schedule shares its last optimizer step over the owner's node: as
        ``spread_last_step`` says, or, left null, for SysX CFG3 where ``allowed`` (one replica,
        ``optim.offload=host``)."""
        if self.spread_last_step is not None:
            return self.spread_last_step
        return allowed and self.schedule == "sysx" and self.cfg == 3

    def describe(self) -> str:
        """One line for the run header."""
        parts = [f"schedule={self.schedule}"]
        if self.stages_per_rank is not None:
            parts.append(f"stages/rank={self.stages_per_rank}")
        if self.schedule == "sysx":
            parts.append(f"cfg={self.cfg}" + (f" d={self.split}" if self.split is not None else ""))
        parts += [f"param buffers={self.param_buffers}", f"cpu adam={self.optim_backend}", f"rollback={self.rollback}"]
        return " ".join(parts)


# of a step's micro-batches, the share whose Head input gradient its forward computes by default: the
# planner's best share lies at 3/8-8/8 on the emulated Fig. 9 cells, and 3/4 gains in each one or ties
# (profiling/long_seq_levers.py, "block, head input grad"; RESULTS, issue 27's fourteenth session)
HEAD_INPUT_GRAD_SHARE = 0.75


def head_igrad_micro_batches(count: int | None, n_micro: int, partition: Partition) -> frozenset[int]:
    """The micro-batches whose Head input gradient the Head's forward computes
    (``schedule.head_input_grad`` of them, spread evenly over the step; None: ``HEAD_INPUT_GRAD_SHARE``
    of them where the Head is a stage of its own, else none), or a :class:`RuntimeConfigError`
    naming the value and the fix."""
    if count is None:
        count = round(HEAD_INPUT_GRAD_SHARE * n_micro) if partition.head_alone else 0
    if count == 0:
        return frozenset()
    if count > n_micro:
        raise RuntimeConfigError(
            f"schedule.head_input_grad={count} is more than the step's {n_micro} micro-batches; "
            f"use at most {n_micro} (train.micro_batches)"
        )
    if not partition.head_alone:
        raise RuntimeConfigError(
            f"schedule.head_input_grad={count} needs the Head as a stage of its own with d = 1 (SysX's block "
            f"layout, the default with 12 flat layers a rank); this run has {partition.n_stages} stages of "
            f"d = {partition.split}: leave schedule.stages_per_rank, split and stage_sizes null, or set it to 0"
        )
    return frozenset(j for j in range(n_micro) if (j + 1) * count // n_micro > j * count // n_micro)


# where the Head is a stage of its own (SysX's block layout), each micro-batch's backward runs in this
# many parts by default: the planner's 30B/40B cells at 4096 tokens reach 1.302x Mobius with 2 and
# 1.294x/1.291x without (RESULTS, issue 27's fifteenth session)
BACKWARD_PARTS = 2


def backward_parts_of(parts: int | None, micro_batch_size: int | None, partition: Partition) -> int:
    """The parts each micro-batch's backward runs in (``schedule.backward_parts``; None:
    ``BACKWARD_PARTS`` where the Head is a stage of its own and ``micro_batch_size`` a multiple of it,
    else 1), or a :class:`RuntimeConfigError` naming the value and the fix."""
    if parts is None:
        fits = micro_batch_size is not None and micro_batch_size % BACKWARD_PARTS == 0
        return BACKWARD_PARTS if partition.head_alone and fits else 1
    if micro_batch_size is not None and micro_batch_size % parts:
        raise RuntimeConfigError(
            f"schedule.backward_parts={parts} must divide train.micro_batch_size={micro_batch_size} (each part is "
            f"rows of the micro-batch); use a divisor of {micro_batch_size} or null"
        )
    return parts


def fits_block_stages(n_flat_layers: int | None, n_ranks: int) -> bool:
    """Whether SysX's default layout is one Block per stage for a model of ``n_flat_layers`` flat
    layers (None: unknown) on ``n_ranks`` pipeline ranks (``BLOCK_STAGES_MIN_LAYERS_PER_RANK``)."""
    return n_flat_layers is not None and n_flat_layers >= BLOCK_STAGES_MIN_LAYERS_PER_RANK * n_ranks


def block_layout(opts: PipelineOptions, schedule: Schedule, model_cfg: ModelConfig) -> bool:
    """Whether :func:`make_schedule` gave ``opts`` (stages per rank and split left null) the
    one-Block-per-stage layout: its stages per rank are no whole number, so the keys stay null."""
    return (
        opts.schedule == "sysx"
        and opts.stages_per_rank is None
        and opts.split is None
        and opts.stage_sizes is None
        and schedule.split == BLOCK_STAGES_SPLIT
        and schedule.n_stages == block_stages(model_cfg.n_layers + 2)
    )


def _keys(keys: PipelineKeys) -> dict[str, Any]:
    """The pipeline keys of ``keys`` (copies: the options and the config do not share a list)."""
    return {f.name: copy.copy(getattr(keys, f.name)) for f in dataclasses.fields(PipelineKeys)}


def options_from_config(cfg: SysxConfig, **overrides: Any) -> PipelineOptions:
    """:class:`PipelineOptions` from ``cfg.schedule`` (``name`` and the pipeline keys) and
    ``cfg.optim`` (``backend``, ``rollback``, ``workers``), then ``overrides``. A schedule name
    ``auto`` means ``sysx`` here."""
    section = cfg.schedule
    values: dict[str, Any] = {"schedule": "sysx" if section.name == "auto" else section.name, **_keys(section)}
    values.update(optim_backend=cfg.optim.backend, rollback=cfg.optim.rollback, optimizer_workers=cfg.optim.workers)
    values.update(overrides)
    opts = PipelineOptions(**values)
    opts.check()
    return opts


def make_schedule(
    opts: PipelineOptions,
    model_cfg: ModelConfig,
    *,
    n_ranks: int,
    n_micro: int,
    seq_len: int,
    ranks_per_node: int | None = None,
    spread_allowed: bool = True,
    micro_batch_size: int | None = None,
) -> Schedule:
    """The validated schedule of this run (identical on every rank).

    The layers are cut by forward FLOPs (or ``stage_sizes``) into ``Nsf`` stages of ``d``
    sub-stages each, trying :meth:`PipelineOptions.candidates` in order; the first that fits the
    model wins, and when none does the error of the preferred one is raised with the fix.
    ``schedule.spread_last_step`` shares the last optimizer step over the owner's node
    (``ranks_per_node`` ranks to a node, numbered node by node; None: one node); left null, it does
    so for SysX CFG3 when ``spread_allowed`` (the job has one replica and ``optim.offload=host``).
    ``micro_batch_size``: sequences per micro-batch, the rows ``schedule.backward_parts`` splits (None:
    unknown, and a null ``backward_parts`` is 1).
    """
    opts.check()
    n_layers = model_cfg.n_layers + 2
    first_error: str | None = None
    for nsf, split in opts.candidates(n_ranks, n_layers):
        if nsf > n_layers:
            # lowering schedule.stages_per_rank helps only when the user set it above 1
            fix = (
                "lower schedule.stages_per_rank, use " if nsf > n_ranks and opts.stages_per_rank is not None else "use "
            )
            need = (
                f"at least {n_ranks} forward stages (one per rank)" if n_ranks > n_layers else f"{nsf} forward stages"
            )
            problem = (
                f"{opts.schedule} with {n_ranks} rank(s) needs {need} but the model has only {n_layers} "
                f"flat layers (embedding + {model_cfg.n_layers} blocks + head); {fix}"
                f"fewer processes or a deeper model (model.n_layers)"
            )
        else:
            try:
                partition = partition_model(model_cfg, seq_len, nsf, split=split, stage_sizes=opts.stage_sizes)
            except PartitionError as err:
                problem = f"cannot partition the model for {opts.schedule} ({nsf} stages, d={split}): {err}"
            else:
                schedule = build(
                    opts.schedule,
                    n_ranks,
                    n_micro,
                    partition,
                    n_stages=nsf,
                    split=split,
                    cfg=opts.cfg,
                    param_buffers=opts.param_buffers,
                    keep_activations=opts.keep_activations,
                    head_igrad=head_igrad_micro_batches(opts.head_input_grad, n_micro, partition)
                    if opts.schedule == "sysx"
                    else frozenset(),
                    backward_parts=backward_parts_of(opts.backward_parts, micro_batch_size, partition)
                    if opts.schedule == "sysx"
                    else (opts.backward_parts or 1),
                )
                schedule = post_receives(schedule)  # the transfers run while the rank computes
                if opts.spreads(spread_allowed):
                    schedule = spread_over_node(schedule, ranks_per_node)
                validate(schedule)
                return schedule
        first_error = first_error or problem
    raise RuntimeConfigError(first_error or f"no candidate partition for {opts.schedule}")
