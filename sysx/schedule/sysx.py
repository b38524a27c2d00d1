"""SysX (paper §3, Fig. 8): decoupled pass assignment, fine-grained backward sub-stages,
asynchronous checkpoint communication and an asynchronous per-sub-stage CPU optimizer.

Each rank runs its forward stages ascending, then its backward sub-stages in execution order, all
micro-batches of each in turn (:func:`sysx.partition.sysx_assignment`). The ablations of the paper's
Table 3 are switches (``cfg``): CFG0 decoupled assignment only, CFG1 + sub-stages, CFG2 +
asynchronous checkpoints, CFG3 + asynchronous CPU optimizer (full SysX, the default).
"""

from __future__ import annotations

from sysx.partition import Partition, PartitionError, sysx_assignment, uniform_partition
from sysx.schedule.common import afab_backwards, afab_forwards, check_counts
from sysx.schedule.lower import lower
from sysx.schedule.ops import Schedule

CFG_FEATURES = {
    0: "decoupled pass assignment",
    1: "CFG0 + fine-grained backward stage partitioning",
    2: "CFG1 + asynchronous activation checkpoint communication",
    3: "CFG2 + asynchronous CPU optimizer",
}


def build_sysx(
    n_ranks: int,
    n_micro: int,
    partition: Partition | None = None,
    *,
    n_stages: int | None = None,
    split: int = 2,
    cfg: int = 3,
    param_buffers: int = 2,
    head_igrad: frozenset[int] = frozenset(),
    backward_parts: int = 1,
) -> Schedule:
    """SysX schedule; the partition gives ``Nsf`` and ``d`` (else ``n_stages`` / ``2 Ng`` and ``split``).

    CFG0 uses the partition's forward stages with ``d = 1``. ``head_igrad``: the micro-batches whose
    Head input gradient its forward computes; ``backward_parts``: the parts each micro-batch's
    backward runs in (both :class:`sysx.schedule.ops.ScheduleOptions`).
    """
    check_counts(n_ranks, n_micro)
    if cfg not in CFG_FEATURES:
        raise PartitionError(f"sysx cfg={cfg!r} must be one of 0, 1, 2, 3 (paper Table 3: {CFG_FEATURES})")
    if partition is None:
        partition = uniform_partition(n_stages if n_stages is not None else 2 * n_ranks, split)
    if cfg == 0 and partition.split != 1:
        partition = partition.with_split(1)
    d = partition.split
    assignment = sysx_assignment(partition.n_stages, d, n_ranks)
    orders = []
    for r in range(n_ranks):
        orders.append(
            afab_forwards(assignment.fwd_stages(r), n_micro) + afab_backwards(assignment.bwd_substages(r), n_micro)
        )
    return lower(
        "sysx",
        partition,
        assignment,
        n_micro,
        orders,
        ckpt="async" if cfg >= 2 else "sync",
        optimizer="async" if cfg >= 3 else "sync",
        param_buffers=param_buffers,
        cfg=cfg,
        head_igrad=head_igrad,
        backward_parts=backward_parts,
    )
