"""Posted receives (sysx.schedule.posted): a far-ahead activation or gradient receive is posted
where it stood and waited for right before its reader, a receive just before its reader is moved
one pass ahead first; the lists stay valid and plan faster."""

from __future__ import annotations

import pytest

from sysx.schedule import (
    Op,
    OpKind,
    Schedule,
    ScheduleError,
    build_1f1b,
    build_gpipe,
    build_interleaved_1f1b,
    build_mobius,
    build_sysx,
    validate,
)
from sysx.schedule.costs import Costs
from sysx.schedule.ops import SEND_OF, WAIT_OF
from sysx.schedule.posted import look_ahead, post_receives, reader
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
            else:  # left blocking only where no pass stands between it and its reader, and looking
                # ahead would gain nothing: no pass before it, or the pass before is its micro-batch's
                assert not any(o.kind in PASSES for o in ops[i + 1 : j])
                before = [o for o in ops[:i] if o.kind in PASSES]
                assert (
                    not before
                    or before[-1].mb == op.mb
                    or any(
                        o.kind in (OpKind.RECV_ACT, OpKind.RECV_GRAD) and o.peer == op.peer
                        for o in ops[ops.index(before[-1]) : i]
                    )
                )
    assert n > 0
    costs = _costs(built.partition.n_layers)
    before = simulate(built, costs.table(built), record=False, memory=False).iteration
    after = simulate(posted, costs.table(posted), record=False, memory=False).iteration
    assert after < before


BUILT = {
    "gpipe": lambda: build_gpipe(4, 8),
    "1f1b": lambda: build_1f1b(4, 8),
    "interleaved": lambda: build_interleaved_1f1b(2, 4, chunks=2),
    "mobius": lambda: build_mobius(4, 8),
    "sysx": lambda: build_sysx(4, 8, n_stages=16, split=3),
}


@pytest.mark.parametrize("name", list(BUILT))
def test_looking_one_pass_ahead_keeps_every_schedule_valid_and_plans_no_slower(name: str) -> None:
    """A chain's receive posted one pass earlier lets its transfer run during that pass: the plan
    loses one transfer per pass on the downstream ranks and the pair orders stay as they were."""
    built = BUILT[name]()
    ahead, plain = post_receives(built), post_receives(built, ahead=False)
    validate(ahead)  # pairing order, dependencies and the deadlock check
    moved = sum(a != b for a, b in zip(ahead.ops, plain.ops))
    assert moved > 0
    costs = _costs(built.partition.n_layers)
    t_ahead = simulate(ahead, costs.table(ahead), record=False, memory=False).iteration
    t_plain = simulate(plain, costs.table(plain), record=False, memory=False).iteration
    assert t_ahead <= t_plain
    if name in ("gpipe", "sysx"):  # chains of passes of one stage over every micro-batch
        assert t_ahead < t_plain


def test_looking_ahead_never_crosses_its_micro_batch_or_a_receive_from_its_peer() -> None:
    """Rank 1 of a 2-rank GPipe: act mb1 moves before F s1 mb0 (another micro-batch), but not when a
    receive from the same peer stands between (the pair's posting order), nor before a same-mb pass."""
    g = build_gpipe(2, 2)
    ops = g.ops[1]
    out = look_ahead(g, ops)
    recv1 = Op(OpKind.RECV_ACT, 0, -1, 1, 0)
    f0 = Op(OpKind.FORWARD, 1, -1, 0)
    assert ops.index(f0) < ops.index(recv1) and out.index(recv1) < out.index(f0)
    blocked = list(ops)
    blocked.insert(blocked.index(recv1), Op(OpKind.RECV_GRAD, 0, 0, 0, 0))  # a receive from rank 0 between
    assert look_ahead(g, tuple(blocked)) == tuple(blocked)
    single = build_gpipe(2, 1)  # one micro-batch: every pass before a receive is of its micro-batch
    assert post_receives(single) is single


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
