"""Validation of one optimizer step across all stages and ranks, in two orders.

**Post-step** (SysX, :func:`post_step_validate`): every stage has already stepped; one all-reduce
decides, an overflow rolls the step back, a global norm above ``max_grad_norm`` re-steps it clipped.
**Validate first** (the baselines, :func:`sync_step`, or its parts :func:`load_and_check` /
:func:`check_reports` and :func:`apply_checked`): check, reduce, then clip and step. Same numbers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sysx.device import Event
from sysx.dist import group_timeout_s, wait_for
from sysx.optim.grad_norm import NormSlots, piece_slots
from sysx.optim.loss_scaler import LossScaler
from sysx.optim.stage import StageOptimizer, StageReport
from sysx.optim.threads import OptimizerThreads

if TYPE_CHECKING:
    from sysx.optim.device_lane import DeviceLane

CLIP_EPS = 1e-6  # as in torch.nn.utils.clip_grad_norm_

log = logging.getLogger("sysx.optim")


@dataclass(frozen=True)
class StepOutcome:
    """What the validation decided for one iteration on this rank."""

    overflow: bool  # some stage on some rank had inf/nan gradients
    skipped: bool  # the step was not applied (rolled back or never taken)
    grad_norm: float  # global L2 norm of the unscaled gradients (inf/nan on overflow)
    clip_coef: float  # factor applied to the gradients (1.0 when not clipped)
    scale: float  # loss scale used for this iteration
    next_scale: float  # loss scale for the next iteration
    undone: int  # stages of this rank rolled back
    restepped: int  # stages of this rank stepped again with clipped gradients
    seconds: float  # time spent validating (reduce + rollback/re-step)


def _world(group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def reduce_flags(
    found_inf: Sequence[bool],
    sq_norms: Sequence[float],
    group: dist.ProcessGroup | None,
    *,
    pieces: Sequence[Sequence[tuple[int, float]]] = (),
    of: int | NormSlots = 0,
) -> tuple[int, float]:
    """Sum ``(#overflowed stages, squared norms of finite stages)`` over all ranks of ``group``.

    ``of``: the squares come per piece of a model of ``of`` pieces (``pieces[i]``: stage ``i``'s
    ``(slot, square)``; :class:`NormSlots`: with the tails of pieces cut between ranks), summed in
    one slot each and rounded once, so every layout gets the same bits (:mod:`sysx.optim.grad_norm`)."""
    n_inf = sum(1 for f in found_inf if f)
    slots = of if isinstance(of, NormSlots) else NormSlots(of)
    if slots.of:
        if any(not p and sq for p, sq in zip(pieces, sq_norms, strict=True)):
            raise ValueError("reduce_flags: a stage reported its squared norm without its pieces")
        parts = [p for f, p in zip(found_inf, pieces) if not f]
        t = torch.cat([piece_slots(parts, slots.length), torch.zeros(1, dtype=torch.float64)])
    else:
        t = torch.tensor([sum(s for f, s in zip(found_inf, sq_norms) if not f), 0.0], dtype=torch.float64)
    t[-1] = float(n_inf)
    if _world(group) > 1:
        wait_for(
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True),
            rank=dist.get_rank(),
            what="VALIDATE (overflow and gradient-norm all-reduce)",
            peer=None,
            timeout_s=group_timeout_s(),
            collective=True,
        )
    values = t.tolist()
    return int(values[-1]), slots.total(values[:-1]) if slots.of else values[0]


def _log_skip(n_inf: int, scale: float, scaler: LossScaler, group: dist.ProcessGroup | None, undone: int) -> None:
    first = _world(group) == 1 or dist.get_rank(group) == 0
    log.log(
        logging.WARNING if first else logging.DEBUG,
        "step skipped: inf/nan gradients in %d stage(s); %d local stage(s) rolled back; loss scale %g -> %g; "
        "skipped steps so far: %d",
        n_inf,
        undone,
        scale,
        float(scaler.scale),
        scaler.skipped_steps,
    )


def clip_coefficient(grad_norm: float, max_grad_norm: float) -> float:
    """``min(1, max_norm / (norm + 1e-6))``; 1.0 when clipping is off (``max_grad_norm <= 0``)."""
    if max_grad_norm <= 0:
        return 1.0
    return min(1.0, max_grad_norm / (grad_norm + CLIP_EPS))


def _run(
    stages: Mapping[str, StageOptimizer],
    threads: OptimizerThreads | None,
    fn: Callable[[StageOptimizer], Any],
    names: Sequence[str],
    label: str,
    *,
    wait: bool = True,
    paced: str | None = None,
) -> list[Any]:
    if threads is None:
        return [fn(stages[n]) for n in names]
    if wait:
        return threads.run_all(fn, names, label, paced=paced)
    for name in names:
        threads.submit(fn, name, label, paced=paced)
    return []


def _stage_map(
    stages: OptimizerThreads | Sequence[StageOptimizer],
) -> tuple[dict[str, StageOptimizer], OptimizerThreads | None]:
    if isinstance(stages, OptimizerThreads):
        return stages.stages, stages
    return {s.name: s for s in stages}, None


def _reduce(
    reports: Sequence[StageReport],
    group: dist.ProcessGroup | None,
    total_norm: Callable[[], float] | None,
    norm_pieces: int | NormSlots = 0,
) -> tuple[int, float]:
    """``(#overflowed stages over all ranks, global gradient norm)`` of this iteration's reports
    (``norm_pieces``: the model's pieces when the stages report their squares per piece)."""
    n_inf, sq = reduce_flags(
        [r.found_inf for r in reports],
        [r.sq_norm for r in reports],
        group,
        pieces=[r.pieces for r in reports],
        of=norm_pieces,
    )
    if total_norm is None:
        return n_inf, math.sqrt(sq) if math.isfinite(sq) else math.inf
    if _world(group) != 1:
        raise ValueError("total_norm: a caller's global norm is for single-process optimizers only")
    return n_inf, total_norm() if n_inf == 0 else math.inf


def _skip(
    n_inf: int, scale: float, scaler: LossScaler, group: dist.ProcessGroup | None, undone: int, t0: float
) -> StepOutcome:
    """Back the scaler off (it raises for bf16/fp32) and report the skipped step."""
    skipped = scaler.update(True)
    _log_skip(n_inf, scale, scaler, group, undone)
    return StepOutcome(
        True, bool(skipped), math.inf, 1.0, scale, float(scaler.scale), undone, 0, time.perf_counter() - t0
    )


def post_step_validate(
    reports: Sequence[StageReport],
    stages: OptimizerThreads | Sequence[StageOptimizer],
    scaler: LossScaler,
    *,
    lr: float,
    max_grad_norm: float = 0.0,
    group: dist.ProcessGroup | None = None,
    total_norm: Callable[[], float] | None = None,
    wait: bool = True,
    norm_pieces: int | NormSlots = 0,
) -> StepOutcome:
    """SysX's post-step validation of an iteration whose stages already stepped (see docs/architecture.md).

    ``reports`` are this rank's :class:`StageReport` s (from :meth:`OptimizerThreads.wait`), in
    the order rollbacks should run; ``stages`` are the stages (an :class:`OptimizerThreads` runs
    rollbacks on its workers); ``lr`` is the learning rate the steps used; ``norm_pieces``: the
    model's pieces when the stages report their squares per piece (:mod:`sysx.optim.grad_norm`).
    Every rank of ``group`` must call this.
    """
    t0 = time.perf_counter()
    by_name, threads = _stage_map(stages)
    scale = float(scaler.scale)
    n_inf, norm = _reduce(reports, group, total_norm, norm_pieces)
    stepped = [r.stage for r in reports if r.stepped]
    if n_inf > 0 or not math.isfinite(norm):
        _run(
            by_name, threads, StageOptimizer.undo, stepped, "undo", paced="undo"
        )  # before the scaler raises (bf16/fp32)
        return _skip(n_inf, scale, scaler, group, len(stepped), t0)
    scaler.update(False)
    coef = clip_coefficient(norm, max_grad_norm)
    restepped = 0
    if coef < 1.0:
        _run(by_name, threads, lambda s: s.restep(coef, lr), stepped, "clip", wait=wait, paced="restep")
        restepped = len(stepped)
    return StepOutcome(False, False, norm, coef, scale, float(scaler.scale), 0, restepped, time.perf_counter() - t0)


def check_reports(
    reports: Sequence[StageReport],
    scaler: LossScaler,
    *,
    max_grad_norm: float = 0.0,
    group: dist.ProcessGroup | None = None,
    total_norm: Callable[[], float] | None = None,
    norm_pieces: int | NormSlots = 0,
) -> StepOutcome:
    """The check part of validate-first over loaded, not yet stepped stages: reduce over ``group``,
    update the scaler (warning on a skipped step) and decide the clip coefficient."""
    t0 = time.perf_counter()
    scale = float(scaler.scale)
    n_inf, norm = _reduce(reports, group, total_norm, norm_pieces)
    if n_inf > 0 or not math.isfinite(norm):
        return _skip(n_inf, scale, scaler, group, 0, t0)
    scaler.update(False)
    coef = clip_coefficient(norm, max_grad_norm)
    return StepOutcome(False, False, norm, coef, scale, float(scaler.scale), 0, 0, time.perf_counter() - t0)


def load_and_check(
    grads: Mapping[str, torch.Tensor],
    stages: OptimizerThreads | Sequence[StageOptimizer],
    scaler: LossScaler,
    *,
    max_grad_norm: float = 0.0,
    group: dist.ProcessGroup | None = None,
    events: Mapping[str, Event] | None = None,
    scale: float | None = None,
    norm_pieces: int | NormSlots = 0,
) -> StepOutcome:
    """The check part of validate-first: load every stage in ``grads`` (after its event, unscaled
    by ``scale``, default the scaler's), then :func:`check_reports` (``norm_pieces`` as there).
    Every rank of ``group`` must call this."""
    by_name, threads = _stage_map(stages)
    scale = float(scaler.scale) if scale is None else scale

    def load(stage: StageOptimizer) -> StageReport:
        if events is not None and stage.name in events:
            events[stage.name].synchronize()
        stage.new_iteration()
        found_inf, sq = stage.load_grads(grads[stage.name], scale=scale)
        stage.drop_grads()  # a lent fp32 buffer goes back until the step converts again (kept ones stay)
        return StageReport(stage=stage.name, found_inf=found_inf, sq_norm=sq, pieces=stage.piece_squares)

    reports = _run(by_name, threads, load, list(grads), "check")
    return check_reports(reports, scaler, max_grad_norm=max_grad_norm, group=group, norm_pieces=norm_pieces)


def apply_checked(stage: StageOptimizer, outcome: StepOutcome, lr: float, lane: DeviceLane | None = None) -> None:
    """The apply part of validate-first: clip and step ``stage`` as ``outcome`` decided (nothing when
    skipped), on the device ``lane`` when one is given (:mod:`sysx.optim.device_lane`)."""
    if outcome.skipped:
        return
    stage.scale_grads(outcome.clip_coef)
    if lane is None:
        stage.apply(lr, final=True)
    else:
        stage.apply_on(lane, lr)


def sync_step(
    grads: Mapping[str, torch.Tensor],
    stages: OptimizerThreads | Sequence[StageOptimizer],
    scaler: LossScaler,
    *,
    lr: float,
    max_grad_norm: float = 0.0,
    group: dist.ProcessGroup | None = None,
    events: Mapping[str, Event] | None = None,
) -> StepOutcome:
    """Validate first, then step (Mobius / Megatron / GPipe order) for every stage in ``grads``.

    Gradients are converted and unscaled with the current loss scale, checked, reduced over
    ``group``; on overflow nothing steps and the scaler backs off, else the gradients are
    clipped and every stage steps. Every rank of ``group`` must call this.
    """
    t0 = time.perf_counter()
    by_name, threads = _stage_map(stages)
    outcome = load_and_check(grads, stages, scaler, max_grad_norm=max_grad_norm, group=group, events=events)
    _run(by_name, threads, lambda s: apply_checked(s, outcome, lr), list(grads), "step")
    return dataclasses.replace(outcome, seconds=time.perf_counter() - t0)
