"""Argument checks and helpers shared by the schedule builders."""

from __future__ import annotations

from sysx.partition import Partition, PartitionError, uniform_partition
from sysx.schedule.ops import Op, OpKind


def check_counts(n_ranks: int, n_micro: int) -> None:
    """Ng and Nm must be positive ints."""
    for name, value in (("n_ranks (Ng)", n_ranks), ("n_micro (Nm)", n_micro)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PartitionError(f"{name}={value!r} must be a positive int")


def whole_stages(partition: Partition | None, n_stages: int, schedule: str) -> Partition:
    """The partition of a coupled schedule: ``split == 1`` (a uniform one when none is given)."""
    if partition is None:
        return uniform_partition(n_stages)
    if partition.split != 1:
        raise PartitionError(
            f"{schedule} runs each stage's backward as one pass but the partition has split d={partition.split}; "
            f"pass partition.with_split(1) (fine-grained backward sub-stages are a sysx feature)"
        )
    return partition


def afab_forwards(stages: list[int], n_micro: int) -> list[Op]:
    """Forward passes of ``stages`` ascending, all micro-batches of each stage in turn."""
    return [Op(OpKind.FORWARD, s, -1, j) for s in sorted(stages) for j in range(n_micro)]


def afab_backwards(substages: list[tuple[int, int]], n_micro: int) -> list[Op]:
    """Backward passes of ``substages`` in the given order, all micro-batches of each in turn."""
    return [Op(OpKind.BACKWARD, s, k, j) for s, k in substages for j in range(n_micro)]
