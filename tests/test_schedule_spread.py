"""The last optimizer step shared by a node's ranks (``sysx.schedule.spread``), planned: one shard
step a rank right before VALIDATE, each starting once the owner's gradients are home and costing
its share, and the schedule checks that refuse a shard of a step nobody takes."""

from __future__ import annotations

import dataclasses

import pytest

from sysx.schedule.costs import UnitCosts
from sysx.schedule.deadlock import Deadlock
from sysx.schedule.ops import Op, OpKind, ScheduleError
from sysx.schedule.simulate import simulate
from sysx.schedule.spread import LAST_UNIT, last_step_owner, spread_last_step, spread_shares
from sysx.schedule.sysx import build_sysx
from sysx.schedule.validate import validate


def test_each_other_rank_gets_one_shard_step_right_before_its_validate() -> None:
    sched = build_sysx(4, 8, n_stages=8, split=2)
    owner = last_step_owner(sched)
    spread = spread_last_step(sched, range(4))
    validate(spread)
    assert spread_shares(spread) == {LAST_UNIT: 4}
    for r, ops in enumerate(spread.ops):
        added = len(ops) - len(sched.ops[r])
        assert added == (0 if r == owner else 1)
        if r != owner:
            assert ops[-2] == Op(OpKind.OPTIM_STEP, *LAST_UNIT, peer=owner, is_async=True)
            assert ops[-1].kind == OpKind.VALIDATE
            assert f"shard of r{owner}" in str(ops[-2])


def test_the_shares_start_when_the_owner_gradients_are_home_and_shorten_the_step() -> None:
    sched = build_sysx(4, 8, n_stages=8, split=2)
    owner = last_step_owner(sched)
    spread = spread_last_step(sched, range(4))
    costs = UnitCosts(1.0, 2.0, t_opt=2.0, optim_workers=1)  # larger steps queue behind the ranks' own
    table = dataclasses.replace(costs.table(sched), offload=[0.5] * len(costs.table(sched).offload))
    timeline = simulate(spread, table)
    home = next(e.end for e in timeline.events if e.op == Op(OpKind.OFFLOAD_GRADS, *LAST_UNIT) and e.rank == owner)
    steps = [e for e in timeline.events if e.op.kind == OpKind.OPTIM_STEP and (e.op.stage, e.op.sub) == LAST_UNIT]
    assert sorted(e.rank for e in steps) == [0, 1, 2, 3]
    whole = table.opt[0]
    for e in steps:
        assert e.start >= home  # a rank that reaches its shard first waits for the owner's offload
        assert e.end - e.start == pytest.approx(whole / 4)
    assert timeline.iteration < simulate(sched, table).iteration


def test_spreading_needs_an_asynchronous_optimizer_and_the_owner_among_the_ranks() -> None:
    with pytest.raises(ScheduleError, match="asynchronous optimizer"):
        spread_last_step(build_sysx(4, 8, n_stages=8, split=2, cfg=2), range(4))
    sched = build_sysx(4, 8, n_stages=8, split=2)
    others = [r for r in range(4) if r != last_step_owner(sched)]
    with pytest.raises(ScheduleError, match=f"leaves out the owner rank {last_step_owner(sched)}"):
        spread_last_step(sched, others)


def test_the_checks_refuse_a_shard_of_a_step_its_peer_does_not_take() -> None:
    sched = build_sysx(4, 8, n_stages=8, split=2)
    owner = last_step_owner(sched)
    spread = spread_last_step(sched, range(4))
    helper = next(r for r in range(4) if r != owner)
    wrong = next(r for r in range(4) if r not in (owner, helper))
    lists = [list(ops) for ops in spread.ops]
    lists[helper][-2] = Op(OpKind.OPTIM_STEP, *LAST_UNIT, peer=wrong, is_async=True)
    bad = spread.with_ops(lists)
    with pytest.raises(ScheduleError, match=f"for rank {wrong}, which does not offload and step it"):
        validate(bad)
    # without the owner's offload the shards wait for gradients that never come, and the report says so
    lists = [list(ops) for ops in spread.ops]
    lists[owner].remove(Op(OpKind.OFFLOAD_GRADS, *LAST_UNIT))
    with pytest.raises(Deadlock, match=f"waits for rank {owner} to offload the gradients it steps"):
        simulate(spread.with_ops(lists))
