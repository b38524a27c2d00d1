"""GPipe (Huang et al. 2019): all forwards, then all backwards, one stage per rank, coupled."""

from __future__ import annotations

from sysx.partition import Partition, PartitionError, coupled_assignment
from sysx.schedule.common import afab_backwards, afab_forwards, check_counts, whole_stages
from sysx.schedule.lower import lower
from sysx.schedule.ops import Schedule


def build_gpipe(n_ranks: int, n_micro: int, partition: Partition | None = None, *, param_buffers: int = 2) -> Schedule:
    """GPipe with ``Nsf == Ng`` stages; rank ``r`` runs stage ``r``'s forwards then its backwards.

    Parameters are offloaded like every sysx schedule: LOAD_PARAMS before use, synchronous CPU
    optimizer after VALIDATE.
    """
    check_counts(n_ranks, n_micro)
    partition = whole_stages(partition, n_ranks, "gpipe")
    if partition.n_stages != n_ranks:
        raise PartitionError(
            f"gpipe places one stage per rank: Nsf={partition.n_stages} stages for Ng={n_ranks} ranks; "
            f"use {n_ranks} stages, or schedule 'mobius' (interleaved AFAB) for more stages than ranks"
        )
    assignment = coupled_assignment(n_ranks, n_ranks)
    orders = [afab_forwards([r], n_micro) + afab_backwards([(r, 0)], n_micro) for r in range(n_ranks)]
    return lower(
        "gpipe", partition, assignment, n_micro, orders, ckpt="local", optimizer="sync", param_buffers=param_buffers
    )
