"""Mobius (Feng et al. 2023; SysX paper Fig. 2): interleaved AFAB, coupled, fully offloaded.

Stage ``s`` runs on rank ``s % Ng``. Each rank runs its forward stages ascending (all
micro-batches of one stage, then the next), then its stages descending (all micro-batches
each). The next stage's parameters are prefetched while the current one computes
(``param_buffers`` GPU buffers); the CPU optimizer steps after the flush and VALIDATE, one
stage after another.
"""

from __future__ import annotations

from sysx.partition import Partition, coupled_assignment, uniform_partition
from sysx.schedule.common import afab_backwards, afab_forwards, check_counts, whole_stages
from sysx.schedule.lower import lower
from sysx.schedule.ops import Schedule


def build_mobius(
    n_ranks: int,
    n_micro: int,
    partition: Partition | None = None,
    *,
    n_stages: int | None = None,
    param_buffers: int = 2,
) -> Schedule:
    """Mobius with ``Nsf`` stages (``partition.n_stages``, else ``n_stages``, else ``2 Ng``)."""
    check_counts(n_ranks, n_micro)
    if partition is None:
        partition = uniform_partition(n_stages if n_stages is not None else 2 * n_ranks)
    partition = whole_stages(partition, partition.n_stages, "mobius")
    assignment = coupled_assignment(partition.n_stages, n_ranks)
    orders = []
    for r in range(n_ranks):
        stages = assignment.fwd_stages(r)
        orders.append(afab_forwards(stages, n_micro) + afab_backwards([(s, 0) for s in reversed(stages)], n_micro))
    return lower(
        "mobius", partition, assignment, n_micro, orders, ckpt="local", optimizer="sync", param_buffers=param_buffers
    )
