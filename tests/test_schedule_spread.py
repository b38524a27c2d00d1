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


# --------------------------------------------------------------------------- the option and its run
@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["schedule=gpipe", "schedule.spread_last_step=true"], ["only sysx reads"]),
        (["schedule=sysx", "schedule.cfg=2", "schedule.spread_last_step=true"], ["use schedule.cfg=3"]),
        (["schedule=sysx", "schedule.spread_last_step=true", "parallel.replicas=2"], ["already shard"]),
        (
            ["schedule=sysx", "schedule.spread_last_step=true", "optim.offload=nvme", "optim.nvme_dir=/tmp"],
            ["optim.offload=host"],
        ),
    ],
)
def test_the_option_is_refused_where_it_cannot_run(overrides: list[str], words: list[str]) -> None:
    from sysx.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="schedule.spread_last_step=True is not valid") as err:
        load_config(overrides)
    assert all(w in str(err.value) for w in words), str(err.value)
    load_config(["schedule=sysx", "schedule.spread_last_step=true"])


def test_the_default_spreads_sysx_cfg3_where_it_runs() -> None:
    from sysx.runtime import PipelineOptions

    assert PipelineOptions(schedule="sysx").spreads()
    assert not PipelineOptions(schedule="sysx").spreads(allowed=False)  # replicas, or the NVMe tier
    assert not PipelineOptions(schedule="sysx", cfg=2).spreads() and not PipelineOptions(schedule="gpipe").spreads()
    assert not PipelineOptions(schedule="sysx", spread_last_step=False).spreads()
    assert PipelineOptions(schedule="sysx", spread_last_step=True).spreads(allowed=False)  # the config refuses it


def test_make_schedule_spreads_over_the_owner_node_only() -> None:
    """4 ranks, 2 to a node: the owner's node-mate gets the one shard step."""
    from sysx.model import ModelConfig
    from sysx.runtime import PipelineOptions, make_schedule
    from sysx.schedule.spread import spread_ranks

    opts = PipelineOptions(schedule="sysx", spread_last_step=True, stages_per_rank=1, split=2)
    model = ModelConfig(vocab_size=256, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    sched = make_schedule(opts, model, n_ranks=4, n_micro=4, seq_len=16, ranks_per_node=2)
    owner = last_step_owner(sched)
    mate = owner ^ 1
    assert spread_ranks(sched) == {LAST_UNIT: sorted([owner, mate])}
    plain = make_schedule(
        dataclasses.replace(opts, spread_last_step=False), model, n_ranks=4, n_micro=4, seq_len=16, ranks_per_node=2
    )
    assert spread_ranks(plain) == {} and plain.ops[owner] == sched.ops[owner]


def test_the_emulated_pacer_charges_each_sharer_its_share() -> None:
    from sysx.emulate.pacer import EmulatedPacer
    from sysx.partition import unit_label
    from tests.test_emulate import _plan

    plan, spread = _plan(1.0)  # sysx CFG3 on 2 ranks: spread by default
    sched = spread.with_ops(
        [[op for op in ops if not (op.kind == OpKind.OPTIM_STEP and op.peer >= 0)] for ops in spread.ops]
    )
    k = spread_shares(spread)[LAST_UNIT]
    whole, shared = (EmulatedPacer(plan, s, 0, time_scale=1.0)._opt for s in (sched, spread))
    name = unit_label(*LAST_UNIT)
    assert k == 2 and shared[name] == pytest.approx(whole[name] / k)
    assert {n: v for n, v in shared.items() if n != name} == {n: v for n, v in whole.items() if n != name}
