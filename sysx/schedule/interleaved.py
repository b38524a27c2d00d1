"""Megatron's interleaved 1F1B (Narayanan et al. 2021) with ``v`` model chunks per rank, offloaded.

Rank ``r``'s chunk ``c`` is stage ``c * Ng + r``; the order follows megatron-core's
``forward_backward_pipelining_with_interleaving``, with micro-batch groups of :func:`group_size`.
Every chunk switch loads its parameters: LOAD_PARAMS/FREE ops move them through ``param_buffers``
GPU buffers (current + prefetch by default).
"""

from __future__ import annotations

from sysx.partition import Partition, PartitionError, coupled_assignment
from sysx.schedule.common import check_counts, whole_stages
from sysx.schedule.lower import lower
from sysx.schedule.ops import Op, OpKind, Schedule


def schedule_table(n_micro: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """Megatron's (micro-batch, chunk) order of the virtual micro-batches on every rank."""
    table: list[tuple[int, int]] = []
    for lo in range(0, n_micro, group):
        hi = n_micro if lo + group >= n_micro else lo + group
        table += [(j, c) for c in range(chunks) for j in range(lo, hi)]
    return table


def group_size(n_ranks: int, n_micro: int) -> int:
    """Smallest Megatron-legal micro-batch group size (see docs/architecture.md)."""
    if n_micro < n_ranks:
        return n_micro
    for g in range(n_ranks, n_micro + 1):
        rest = n_micro % g
        if rest == 0 or rest >= n_ranks:
            return g
    return n_micro


def interleaved_order(rank: int, n_ranks: int, n_micro: int, chunks: int) -> list[Op]:
    """Compute order of ``rank`` (see docs/architecture.md)."""
    group = group_size(n_ranks, n_micro)
    table = schedule_table(n_micro, chunks, group)
    total = len(table)
    warm = min(2 * (n_ranks - rank - 1) + (chunks - 1) * group, total)

    def fwd(i: int) -> Op:
        j, c = table[i]
        return Op(OpKind.FORWARD, c * n_ranks + rank, -1, j)

    def bwd(i: int) -> Op:
        j, c = table[i]
        return Op(OpKind.BACKWARD, (chunks - 1 - c) * n_ranks + rank, 0, j)

    order = [fwd(i) for i in range(warm)]
    for i in range(total - warm):
        order.append(fwd(warm + i))
        order.append(bwd(i))
    order += [bwd(i) for i in range(total - warm, total)]
    return order


def build_interleaved_1f1b(
    n_ranks: int, n_micro: int, partition: Partition | None = None, *, chunks: int = 2, param_buffers: int = 2
) -> Schedule:
    """Interleaved 1F1B; ``Nsf = chunks * Ng`` (taken from ``partition`` when given)."""
    check_counts(n_ranks, n_micro)
    if partition is not None:
        if partition.n_stages % n_ranks:
            raise PartitionError(
                f"interleaved_1f1b gives every rank the same number of chunks: Nsf={partition.n_stages} is not a "
                f"multiple of Ng={n_ranks}; use {n_ranks * max(1, partition.n_stages // n_ranks)} or "
                f"{n_ranks * (partition.n_stages // n_ranks + 1)} stages"
            )
        chunks = partition.n_stages // n_ranks
    if not isinstance(chunks, int) or chunks < 1:
        raise PartitionError(f"chunks (v)={chunks!r} must be a positive int")
    partition = whole_stages(partition, chunks * n_ranks, "interleaved_1f1b")
    assignment = coupled_assignment(partition.n_stages, n_ranks)
    orders = [interleaved_order(r, n_ranks, n_micro, chunks) for r in range(n_ranks)]
    return lower(
        "interleaved_1f1b",
        partition,
        assignment,
        n_micro,
        orders,
        ckpt="local",
        optimizer="sync",
        param_buffers=param_buffers,
    )
