"""The forward-only evaluation program of a schedule: :func:`evaluation_schedule`.

Every rank runs its forward stages ascending, each loaded, all micro-batches received, computed
and sent on, then freed. Every rank's list is a subsequence of one global order in which each
send is directly followed by its receive, so blocking transfers cannot deadlock; the result is a
:class:`Schedule` with ``options.training`` False, checked by the same ``validate``.
"""

from __future__ import annotations

from dataclasses import replace

from sysx.schedule.common import check_counts
from sysx.schedule.ops import F, Op, OpKind, Schedule


def _rank_program(schedule: Schedule, rank: int, n_micro: int) -> tuple[Op, ...]:
    fwd = schedule.assignment.fwd_rank
    ops: list[Op] = []
    for s in schedule.assignment.fwd_stages(rank):
        ops.append(Op(OpKind.LOAD_PARAMS, s, -1))
        if s > 0 and fwd[s - 1] != rank:
            ops += [Op(OpKind.RECV_ACT, s - 1, -1, j, fwd[s - 1]) for j in range(n_micro)]
        ops += [F(s, j) for j in range(n_micro)]
        if s < schedule.n_stages - 1 and fwd[s + 1] != rank:
            ops += [Op(OpKind.SEND_ACT, s, -1, j, fwd[s + 1]) for j in range(n_micro)]
        ops.append(Op(OpKind.FREE, s, -1))
    return tuple(ops)


def evaluation_schedule(schedule: Schedule, n_micro: int) -> Schedule:
    """The forward passes of ``schedule``'s assignment over ``n_micro`` micro-batches, no training ops."""
    check_counts(schedule.n_ranks, n_micro)
    ops = tuple(_rank_program(schedule, r, n_micro) for r in range(schedule.n_ranks))
    return replace(schedule, n_micro=n_micro, ops=ops, ckpt_plan=(), options=replace(schedule.options, training=False))
