"""Each micro-batch's backward in parts of its rows (``schedule.backward_parts``, issue 27): the
lowering runs a micro-batch's parts in a row on one rank, sends their gradients part by part and
its checkpoint once; the checks, the planner and the emulator's pacer agree; the key's default and
errors. Parity with the reference runs in tests/test_runtime.py (one rank) and
tests/test_runtime_procs.py (4 ranks on 2 nodes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sysx.config import ConfigError, refuse_ignored_keys
from sysx.config.sections import ScheduleSection
from sysx.model import get_preset
from sysx.partition import partition_model
from sysx.runtime import PipelineOptions, RuntimeConfigError, make_schedule
from sysx.runtime.options import BACKWARD_PARTS, backward_parts_of
from sysx.schedule import Op, OpKind, Schedule, ScheduleError, build, simulate, validate
from sysx.schedule.costs import Costs
from sysx.schedule.lower import logical_times
from sysx.schedule.ops import B, F

TINY = dataclasses.replace(get_preset("tiny"), n_layers=14)  # 16 flat layers
SIZES = [3, 2, 2, 2, 2, 2, 2, 1]  # 8 stages on 4 ranks, the Head alone on rank 3
COSTS = Costs(
    layer_fwd_time=(0.1,) + (1.0,) * 14 + (0.5,),
    layer_params=(1e6,) * 16,
    act_bytes=1e6,
    p2p_latency=0.0,
    p2p_bandwidth=1e6,  # a micro-batch's activation or gradient: 1 s
)


def parts_schedule(parts: int, split: int = 2) -> Schedule:
    return build("sysx", 4, 4, partition_model(TINY, 16, 8, split=split), split=split, backward_parts=parts)


def of_kind(sched: Schedule, kind: OpKind) -> list[tuple[int, Op]]:
    return [(r, op) for r, ops in enumerate(sched.ops) for op in ops if op.kind == kind]


def test_each_backward_runs_in_parts_in_a_row_sending_gradients_by_part_and_the_checkpoint_once() -> None:
    whole, halves = parts_schedule(1), parts_schedule(2)
    validate(halves)
    assert halves.n_backward == 8 and whole.n_backward == 4
    assert len(of_kind(halves, OpKind.BACKWARD)) == 2 * len(of_kind(whole, OpKind.BACKWARD))
    assert len(of_kind(halves, OpKind.SEND_GRAD)) == 2 * len(of_kind(whole, OpKind.SEND_GRAD))
    # one checkpoint per micro-batch and sub-stage, sent where it was (parts read it, the last frees it)
    assert of_kind(halves, OpKind.SEND_CKPT) == of_kind(whole, OpKind.SEND_CKPT)
    assert len(halves.ckpt_plan) == len(whole.ckpt_plan)
    for r, ops in enumerate(halves.ops):
        passes = [op for op in ops if op.kind == OpKind.BACKWARD]
        for a, b in zip(passes[::2], passes[1::2], strict=True):  # part 0 then part 1 of one micro-batch
            assert (b.stage, b.sub, b.mb) == (a.stage, a.sub, a.mb + 1) and a.mb % 2 == 0, (r, a, b)
        waits = [i for i, op in enumerate(ops) if op.kind == OpKind.WAIT_CKPT]
        for i in waits:  # the checkpoint is waited for right before the micro-batch's first part
            op, nxt = ops[i], next(x for x in ops[i:] if x.kind == OpKind.BACKWARD)
            assert (nxt.stage, nxt.sub, nxt.mb) == (op.stage, op.sub, 2 * op.mb)
    # the gradient of a part leaves right after that part: the next rank starts on it while this one
    # runs the other part
    r, send = next((r, op) for r, op in of_kind(halves, OpKind.SEND_GRAD) if op.mb % 2 == 0)
    ops = list(halves.ops[r])
    at = ops.index(send)
    assert ops.index(B(send.stage, send.sub, send.mb)) < at < ops.index(B(send.stage, send.sub, send.mb + 1))


def test_the_checks_refuse_parts_out_of_order_or_apart() -> None:
    sched = parts_schedule(2)
    ops = list(sched.ops[0])
    first = next(i for i, op in enumerate(ops) if op.kind == OpKind.BACKWARD)
    second = next(i for i in range(first + 1, len(ops)) if ops[i].kind == OpKind.BACKWARD)
    ops[first], ops[second] = ops[second], ops[first]
    swapped = sched.with_ops([ops, *sched.ops[1:]])
    with pytest.raises(
        ScheduleError, match=r"runs before `B s\d+\.\d+ mb0` here; a micro-batch.s backward parts run in order"
    ):
        validate(swapped)
    # split orders that put a micro-batch's parts on two ranks cannot share its checkpoint
    part = partition_model(TINY, 16, 2, split=1)
    orders = [[F(0, 0), F(1, 0), B(1, 0, 0), B(0, 0, 0)], [B(1, 0, 1), B(0, 0, 1)]]
    with pytest.raises(ScheduleError, match=r"run on another rank than their micro-batch's part 0"):
        logical_times(orders, part, 1, parts=2)
    logical_times([orders[0] + orders[1], []], part, 1, parts=2)  # together they run


def test_the_plan_charges_a_part_its_share_of_the_backward_and_its_gradient() -> None:
    whole, halves = parts_schedule(1), parts_schedule(2)
    table = COSTS.table(whole)
    a, b = simulate(whole, table, record=True), simulate(halves, table, record=True)
    assert sum(b.busy) == pytest.approx(sum(a.busy))  # the same work, in twice as many passes
    took = {e.op: e.end - e.start for e in b.events if e.lane == "gpu" and e.op.kind == OpKind.BACKWARD}
    for op, seconds in took.items():
        assert seconds == pytest.approx(table.bwd[op.stage * 2 + op.sub] / 2), op
    grads = [e for e in b.events if e.lane == "p2p" and e.op.kind == OpKind.SEND_GRAD]
    assert grads and all(e.end - e.start == pytest.approx(0.5) for e in grads)  # half the rows


def test_the_key_s_default_splits_in_two_where_the_head_is_alone_and_the_rows_allow() -> None:
    alone = partition_model(TINY, 16, len(SIZES), split=1, stage_sizes=SIZES)
    cut = partition_model(TINY, 16, 4, split=2)
    assert BACKWARD_PARTS == 2
    assert backward_parts_of(None, 2, alone) == 2
    assert backward_parts_of(None, 4, alone) == 2
    assert backward_parts_of(None, 1, alone) == 1  # one row: nothing to split
    assert backward_parts_of(None, None, alone) == 1  # rows unknown
    assert backward_parts_of(None, 2, cut) == 1
    assert backward_parts_of(4, 4, cut) == 4
    opts = PipelineOptions(split=1, stage_sizes=SIZES)
    sched = make_schedule(opts, TINY, n_ranks=4, n_micro=4, seq_len=16, micro_batch_size=2)
    assert sched.options.backward_parts == 2
    off = dataclasses.replace(opts, backward_parts=1)
    assert make_schedule(off, TINY, n_ranks=4, n_micro=4, seq_len=16, micro_batch_size=2).options.backward_parts == 1


def test_the_key_s_errors_name_the_value_and_the_fix() -> None:
    with pytest.raises(RuntimeConfigError, match=r"backward_parts=3 must divide train.micro_batch_size=2"):
        make_schedule(PipelineOptions(backward_parts=3), TINY, n_ranks=2, n_micro=4, seq_len=16, micro_batch_size=2)
    with pytest.raises(RuntimeConfigError, match=r"schedule.backward_parts=2 is not valid for mobius"):
        make_schedule(PipelineOptions(schedule="mobius", backward_parts=2), TINY, n_ranks=2, n_micro=4, seq_len=16)
    with pytest.raises(ScheduleError, match=r"backward_parts=2 splits SysX's backward sub-stages; mobius has none"):
        build("mobius", 2, 4, partition_model(TINY, 16, 4, split=1), backward_parts=2)
    with pytest.raises(ConfigError, match=r"schedule.backward_parts=2 is not valid for gpipe"):
        refuse_ignored_keys("gpipe", ScheduleSection(name="gpipe", backward_parts=2))
    refuse_ignored_keys("gpipe", ScheduleSection(name="gpipe", backward_parts=1))  # what they run anyway
    with pytest.raises(ConfigError, match=r"schedule.backward_parts"):
        ScheduleSection(name="sysx", backward_parts=0).validate()
    with pytest.raises(ScheduleError, match=r"keep_activations backpropagates the forward's graph whole"):
        dataclasses.replace(parts_schedule(2).options, keep_activations=True, ckpt="local")


def test_the_emulated_device_paces_each_part_as_the_plan_does() -> None:
    """The emulator's pacer charges each pass and each gradient what the planner does (the emulated
    7B on 2 ranks: the block layout, 2 sequences a micro-batch, so 2 parts and both Head input
    gradients moved by default)."""
    from sysx.emulate.costs import emulated_model, plan_emulation
    from sysx.emulate.pacer import EmulatedPacer
    from sysx.runtime.p2p import TransferSpec
    from sysx.schedule import Message
    from tests.test_emulate import _plan_cfg

    cfg = _plan_cfg(1.0)
    model = emulated_model(cfg)
    sched = make_schedule(
        PipelineOptions(optim_backend="torch"),
        model.config,
        n_ranks=2,
        n_micro=2,
        seq_len=model.seq_len,
        micro_batch_size=2,
    )
    assert (sched.options.backward_parts, sched.options.head_igrad) == (2, {0, 1})
    plan = plan_emulation(cfg, sched, backend="torch")
    events = simulate(sched, plan.table, record=True, memory=False).events
    for r in range(2):
        pacer = EmulatedPacer(plan, sched, r, time_scale=1.0)
        for e in events:
            if e.rank == r and e.lane == "gpu" and e.op.kind in (OpKind.FORWARD, OpKind.BACKWARD):
                assert pacer._seconds(e.op) == pytest.approx(e.end - e.start), e.op
    spec = TransferSpec(Message.GRAD, 3, 0, 1, (1, 4, 8), torch.bfloat16)
    assert pacer._xfer(spec) == pytest.approx(plan.table.grad_xfer[3] / 2)
    assert {e.op.mb for e in events if e.op.kind == OpKind.BACKWARD} == {0, 1, 2, 3}
