"""The Head's input gradient computed by its forward (``schedule.head_input_grad``, issue 27): the
lowering sends it from the Head's forward rank, the checks hold the schedule to that, the planner
moves the work, and the defaults and errors of the key. Parity with the reference runs in
tests/test_runtime.py (one rank) and tests/test_runtime_procs.py (4 ranks on 2 nodes)."""

from __future__ import annotations

import dataclasses

import pytest

from sysx.config import ConfigError, refuse_ignored_keys
from sysx.config.sections import ScheduleSection
from sysx.model import get_preset
from sysx.partition import partition_model
from sysx.runtime import PipelineOptions, RuntimeConfigError, make_schedule
from sysx.runtime.options import HEAD_INPUT_GRAD_SHARE, head_igrad_micro_batches
from sysx.schedule import Op, OpKind, Schedule, ScheduleError, build, simulate, validate
from sysx.schedule.costs import Costs

TINY = dataclasses.replace(get_preset("tiny"), n_layers=14)  # 16 flat layers
SIZES = [3, 2, 2, 2, 2, 2, 2, 1]  # 8 stages on 4 ranks, the Head alone on rank 3


def head_schedule(moved: frozenset[int], n_micro: int = 4) -> Schedule:
    part = partition_model(TINY, 16, len(SIZES), split=1, stage_sizes=SIZES)
    return build("sysx", 4, n_micro, part, split=1, head_igrad=moved)


def grad_sends(sched: Schedule) -> dict[int, int]:
    """Micro-batch -> rank of the SEND_GRAD of the Head's input gradient."""
    head = sched.n_stages - 1
    return {
        op.mb: r for r, ops in enumerate(sched.ops) for op in ops if op.kind == OpKind.SEND_GRAD and op.stage == head
    }


def test_the_moved_input_gradients_leave_from_the_head_s_forward_rank() -> None:
    sched = head_schedule(frozenset({1, 3}))
    a, head = sched.assignment, sched.n_stages - 1
    fwd_rank, bwd_rank = a.fwd_rank[head], a.bwd_rank[head][0]
    assert (fwd_rank, bwd_rank) == (3, 0)
    assert grad_sends(sched) == {0: bwd_rank, 1: fwd_rank, 2: bwd_rank, 3: fwd_rank}
    # the sub-stage before the Head takes its gradient from the Head's forward rank, which sends it
    # after that micro-batch's forward
    ops = sched.ops[fwd_rank]
    for j in (1, 3):
        send = next(i for i, op in enumerate(ops) if op.kind == OpKind.SEND_GRAD and op.mb == j)
        fwd = ops.index(Op(OpKind.FORWARD, head, -1, j))
        assert fwd < send
    validate(sched)
    assert grad_sends(head_schedule(frozenset())) == dict.fromkeys(range(4), bwd_rank)


def test_the_checks_refuse_a_gradient_sent_before_it_is_computed() -> None:
    """The lists of a moved schedule read under options that do not move it: the Head's forward
    rank would send a gradient no backward of its computed."""
    sched = head_schedule(frozenset({1, 3}))
    wrong = dataclasses.replace(sched, options=dataclasses.replace(sched.options, head_igrad=frozenset()))
    with pytest.raises(ScheduleError, match=r"sends the input gradient of s7\.0 mb1 before computing it here"):
        validate(wrong)


def test_only_a_head_of_its_own_in_sysx_moves() -> None:
    part = partition_model(TINY, 16, 4, split=2)
    with pytest.raises(ScheduleError, match="head_igrad needs the Head as a forward stage of its own"):
        build("sysx", 2, 4, part, split=2, head_igrad=frozenset({0}))
    alone = partition_model(TINY, 16, len(SIZES), split=1, stage_sizes=SIZES)
    with pytest.raises(ScheduleError, match="mobius has none to move"):
        build("mobius", 4, 4, alone, head_igrad=frozenset({0}))
    with pytest.raises(ScheduleError, match=r"micro-batches \[4\] outside 0..3"):
        build("sysx", 4, 4, alone, split=1, head_igrad=frozenset({4}))


def test_the_plan_moves_one_input_gradient_of_work_to_the_head_s_forward() -> None:
    costs = Costs(
        layer_fwd_time=(0.1,) + (1.0,) * 14 + (0.5,),
        layer_params=(1e6,) * 16,
        act_bytes=1e6,
        p2p_latency=0.0,
        p2p_bandwidth=1e15,
    )
    sched = head_schedule(frozenset({1, 3}))
    table = costs.table(sched)
    assert table.head_igrad == pytest.approx(0.5)  # a Head forward's FLOPs, half its backward
    head = sched.n_stages - 1
    tl = simulate(sched, table, record=True, memory=False)
    took = {(e.op.kind, e.op.mb): e.end - e.start for e in tl.events if e.op.stage == head and e.lane == "gpu"}
    for j in range(4):
        moved = j in (1, 3)
        assert took[(OpKind.FORWARD, j)] == pytest.approx(0.5 + (0.5 if moved else 0.0))
        assert took[(OpKind.BACKWARD, j)] == pytest.approx(1.5 - (0.5 if moved else 0.0))
    assert sum(tl.busy) == pytest.approx(sum(simulate(head_schedule(frozenset()), table, memory=False).busy))


def test_the_key_s_default_moves_three_quarters_where_the_head_is_alone() -> None:
    alone = partition_model(TINY, 16, len(SIZES), split=1, stage_sizes=SIZES)
    assert HEAD_INPUT_GRAD_SHARE == 0.75
    assert head_igrad_micro_batches(None, 4, alone) == {1, 2, 3}  # spread over the step
    assert head_igrad_micro_batches(2, 4, alone) == {1, 3}
    assert head_igrad_micro_batches(0, 4, alone) == frozenset()
    assert head_igrad_micro_batches(None, 4, partition_model(TINY, 16, 4, split=2)) == frozenset()
    sched = make_schedule(PipelineOptions(split=1, stage_sizes=SIZES), TINY, n_ranks=4, n_micro=8, seq_len=16)
    assert sched.options.head_igrad == {1, 2, 3, 5, 6, 7}
    off = make_schedule(
        PipelineOptions(split=1, stage_sizes=SIZES, head_input_grad=0), TINY, n_ranks=4, n_micro=8, seq_len=16
    )
    assert off.options.head_igrad == frozenset()
    assert (
        make_schedule(PipelineOptions(schedule="mobius"), TINY, n_ranks=4, n_micro=8, seq_len=16).options.head_igrad
        == frozenset()
    )


def test_the_key_s_errors_name_the_value_and_the_fix() -> None:
    with pytest.raises(RuntimeConfigError, match=r"head_input_grad=9 is more than the step's 8 micro-batches"):
        make_schedule(
            PipelineOptions(split=1, stage_sizes=SIZES, head_input_grad=9), TINY, n_ranks=4, n_micro=8, seq_len=16
        )
    with pytest.raises(RuntimeConfigError, match=r"head_input_grad=2 needs the Head as a stage of its own"):
        make_schedule(PipelineOptions(stages_per_rank=2, head_input_grad=2), TINY, n_ranks=2, n_micro=4, seq_len=16)
    with pytest.raises(ConfigError, match=r"schedule.head_input_grad=2 is not valid for mobius"):
        refuse_ignored_keys("mobius", ScheduleSection(name="mobius", head_input_grad=2))
    with pytest.raises(ConfigError, match=r"schedule.head_input_grad"):
        ScheduleSection(name="sysx", head_input_grad=-1).validate()


def test_the_emulated_device_paces_the_moved_work_as_the_plan_does() -> None:
    """The emulator's pacer charges each pass what the planner does, moved input gradients included
    (the emulated 7B on 2 ranks: the block layout, both micro-batches moved by default)."""
    from sysx.emulate.costs import emulated_model, plan_emulation
    from sysx.emulate.pacer import EmulatedPacer
    from tests.test_emulate import _plan_cfg

    cfg = _plan_cfg(1.0)
    model = emulated_model(cfg)
    sched = make_schedule(
        PipelineOptions(optim_backend="torch"), model.config, n_ranks=2, n_micro=2, seq_len=model.seq_len
    )
    assert sched.options.head_igrad == {0, 1}
    plan = plan_emulation(cfg, sched, backend="torch")
    events = simulate(sched, plan.table, record=True, memory=False).events
    head = sched.n_stages - 1
    for r in range(2):
        pacer = EmulatedPacer(plan, sched, r, time_scale=1.0)
        for e in events:
            if e.rank == r and e.lane == "gpu" and e.op.kind in (OpKind.FORWARD, OpKind.BACKWARD):
                assert pacer._seconds(e.op) == pytest.approx(e.end - e.start), e.op
    heads = [e for e in events if e.op.stage == head and e.lane == "gpu"]
    assert {e.op.kind for e in heads} == {OpKind.FORWARD, OpKind.BACKWARD}
