"""1F1B (DAPPLE, Fan et al. 2021; Megatron's non-interleaved order), one stage per rank, coupled."""

from __future__ import annotations

from sysx.partition import Partition, PartitionError, coupled_assignment
from sysx.schedule.common import check_counts, whole_stages
from sysx.schedule.lower import lower
from sysx.schedule.ops import Op, OpKind, Schedule


def one_f_one_b_order(rank: int, stage: int, n_ranks: int, n_micro: int) -> list[Op]:
    """Megatron's order on ``rank``: ``min(Ng-rank-1, Nm)`` warm-up forwards, 1F1B pairs, cool-down."""
    warm = min(n_ranks - rank - 1, n_micro)
    order = [Op(OpKind.FORWARD, stage, -1, j) for j in range(warm)]
    for i in range(n_micro - warm):
        order.append(Op(OpKind.FORWARD, stage, -1, warm + i))
        order.append(Op(OpKind.BACKWARD, stage, 0, i))
    order += [Op(OpKind.BACKWARD, stage, 0, j) for j in range(n_micro - warm, n_micro)]
    return order


def build_1f1b(n_ranks: int, n_micro: int, partition: Partition | None = None, *, param_buffers: int = 2) -> Schedule:
    """1F1B with ``Nsf == Ng`` stages (rank ``r`` runs stage ``r``), synchronous CPU optimizer."""
    check_counts(n_ranks, n_micro)
    partition = whole_stages(partition, n_ranks, "1f1b")
    if partition.n_stages != n_ranks:
        raise PartitionError(
            f"1f1b places one stage per rank: Nsf={partition.n_stages} stages for Ng={n_ranks} ranks; "
            f"use {n_ranks} stages, or schedule 'interleaved_1f1b' for several stages per rank"
        )
    assignment = coupled_assignment(n_ranks, n_ranks)
    orders = [one_f_one_b_order(r, r, n_ranks, n_micro) for r in range(n_ranks)]
    return lower(
        "1f1b", partition, assignment, n_micro, orders, ckpt="local", optimizer="sync", param_buffers=param_buffers
    )
