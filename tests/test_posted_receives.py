"""Posted receives (sysx.schedule.posted): a far-ahead activation or gradient receive is posted
where it stood and waited for right before its reader; the lists stay valid and plan faster."""

from __future__ import annotations

import pytest

from sysx.schedule import Op, OpKind, Schedule, ScheduleError, build_gpipe, build_mobius, build_sysx, validate
from sysx.schedule.costs import Costs
from sysx.schedule.ops import SEND_OF, WAIT_OF
from sysx.schedule.posted import post_receives, reader
from sysx.schedule.simulate import simulate

PASSES = (OpKind.FORWARD, OpKind.BACKWARD)


def _costs(n_layers: int) -> Costs:
    return Costs(layer_fwd_time=(1e-3,) * n_layers, layer_params=(1e6,) * n_layers, act_bytes=4e6, posted_sends=True)


@pytest.mark.parametrize("built", [build_sysx(4, 8, n_stages=16, split=3), build_mobius(4, 8)], ids=["sysx", "mobius"])
def test_posted_receives_wait_right_before_their_reader_and_plan_faster(built: Schedule) -> None:
    posted = post_receives(built)
    validate(posted)
    n = 0
    for r, ops in enumerate(posted.ops):
        for i, op in enumerate(ops):
            if op.kind not in (OpKind.RECV_ACT, OpKind.RECV_GRAD):
                continue
            j = ops.index(reader(posted, op))
            if op.is_async:  # posted: passes in between, the wait right before the reader, the send async too
                n += 1
                assert any(o.kind in PASSES for o in ops[i + 1 : j])
                assert ops[j - 1] == Op(WAIT_OF[op.message[0]], op.stage, op.sub, op.mb, op.peer)
                assert Op(SEND_OF[op.message[0]], op.stage, op.sub, op.mb, r, True) in posted.ops[op.peer]
            else:  # left blocking only where no pass stands between it and its reader
                assert not any(o.kind in PASSES for o in ops[i + 1 : j])
    assert n > 0
    costs = _costs(built.partition.n_layers)
    before = simulate(built, costs.table(built), record=False, memory=False).iteration
    after = simulate(posted, costs.table(posted), record=False, memory=False).iteration
    assert after < before


def test_a_schedule_without_far_ahead_receives_is_left_as_it_is() -> None:
    g = build_gpipe(2, 2)
    assert post_receives(g) is g


def test_a_missing_or_unposted_wait_is_rejected() -> None:
    s = post_receives(build_mobius(2, 4))
    r, at = next((r, i) for r, ops in enumerate(s.ops) for i, op in enumerate(ops) if op.kind == OpKind.WAIT_ACT)
    ops = list(s.ops[r])
    wait = ops.pop(at)
    lists = list(s.ops)
    lists[r] = tuple(ops)
    with pytest.raises(ScheduleError, match="its async RECV_ACT was posted but no WAIT_ACT precedes it"):
        validate(s.with_ops(lists))
    ops.insert(0, wait)  # waited for before it is posted
    lists[r] = tuple(ops)
    with pytest.raises(ScheduleError, match="waits for the activation whose async RECV_ACT was not posted before"):
        validate(s.with_ops(lists))
