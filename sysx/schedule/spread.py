"""The iteration's last optimizer step shared by the ranks of its owner's node (issue 27): a pass.

The ring's last backward sub-stage, ``(0, 0)`` (the Embedding and the first blocks), is the last
unit whose gradients come home, so its CPU Adam step is the iteration's last work: VALIDATE waits
for it while the node's other ranks are done. :func:`spread_last_step` gives each of them a shard
of that step: an asynchronous OPTIM_STEP of the unit with ``peer`` = its owner, right before the
rank's VALIDATE. Each of the ``k`` participants (the owner too) steps ``1/k`` of the unit, from
when the owner's offload is home (:func:`spread_shares` says who shares what; the engine charges
it so).

``schedule.spread_last_step=true`` applies it over the owner's node (:func:`spread_over_node`);
the runtime then holds the unit's fp32 master and Adam state in ``k`` shards, one per participant
(:func:`spread_ranks` orders them), and hands the owner's offloaded gradients over through the
node's shared memory (:mod:`sysx.runtime.spread_sync`).
"""

from __future__ import annotations

from collections.abc import Sequence

from sysx.schedule.ops import Op, OpKind, Schedule, ScheduleError

LAST_UNIT = (0, 0)  # the ring backpropagates sub-stages from the last down: (0, 0) comes home last


def spread_last_step(schedule: Schedule, ranks: Sequence[int]) -> Schedule:
    """``schedule`` with the step of :data:`LAST_UNIT` shared by ``ranks`` (its owner among them):
    every other rank of ``ranks`` gets a shard step right before its VALIDATE. Raises
    :class:`ScheduleError` for a synchronous optimizer or an owner outside ``ranks``."""
    if not schedule.options.async_optimizer:
        raise ScheduleError(
            f"{schedule.name}: the last optimizer step can be spread only with an asynchronous optimizer "
            f"(optimizer={schedule.options.optimizer!r}): a synchronous step runs after VALIDATE anyway"
        )
    owner = last_step_owner(schedule)
    if owner not in ranks:
        raise ScheduleError(f"{schedule.name}: spreading over ranks {list(ranks)} leaves out the owner rank {owner}")
    lists = [list(ops) for ops in schedule.ops]
    for r in dict.fromkeys(ranks):
        if r == owner:
            continue
        if not 0 <= r < schedule.n_ranks:
            raise ScheduleError(f"{schedule.name}: rank {r} is outside the {schedule.n_ranks} ranks")
        at = next(i for i, op in enumerate(lists[r]) if op.kind == OpKind.VALIDATE)
        lists[r].insert(at, Op(OpKind.OPTIM_STEP, *LAST_UNIT, peer=owner, is_async=True))
    return schedule.with_ops(lists)


def spread_over_node(schedule: Schedule, ranks_per_node: int | None = None) -> Schedule:
    """:func:`spread_last_step` over the ranks of the owner's node (ranks are numbered node by node,
    ``ranks_per_node`` to a node; None: every rank is on one node)."""
    per_node = schedule.n_ranks if ranks_per_node is None else ranks_per_node
    node = last_step_owner(schedule) // per_node
    return spread_last_step(schedule, [r for r in range(schedule.n_ranks) if r // per_node == node])


def spread_ranks(schedule: Schedule) -> dict[tuple[int, int], list[int]]:
    """``{unit: ranks}``: the units whose step several ranks share, each with its participants in
    rank order (the owner among them); participant ``i`` of ``k`` steps
    :func:`sysx.replicas.shard_range` ``(numel, k, i)`` of the unit."""
    ranks: dict[tuple[int, int], set[int]] = {}
    for r, ops in enumerate(schedule.ops):
        for op in ops:
            if op.kind == OpKind.OPTIM_STEP and op.peer >= 0:
                ranks.setdefault((op.stage, op.sub), {op.peer}).add(r)
    return {unit: sorted(rs) for unit, rs in ranks.items()}


def spread_shares(schedule: Schedule) -> dict[tuple[int, int], int]:
    """``{unit: k}``: the units whose step ``k`` ranks share (their owner and its shard steps')."""
    return {unit: len(ranks) for unit, ranks in spread_ranks(schedule).items()}


def last_step_owner(schedule: Schedule) -> int:
    """The rank that offloads (and steps) :data:`LAST_UNIT`'s gradients."""
    for r, ops in enumerate(schedule.ops):
        if any(op.kind == OpKind.OFFLOAD_GRADS and (op.stage, op.sub) == LAST_UNIT for op in ops):
            return r
    raise ScheduleError(f"{schedule.name}: no rank offloads the gradients of s0.0 (not a training schedule?)")
