"""The long-sequence what-if study (planner only, one cell): every lever plans a step no slower
than today's, and none beats the busiest rank's zero-idle ceiling except by cutting work."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "long_seq_levers", Path(__file__).parents[1] / "profiling" / "long_seq_levers.py"
)
assert _SPEC is not None and _SPEC.loader is not None
levers = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(levers)


def test_each_lever_plans_no_slower_than_today_and_the_ceiling_bounds_the_idle_cuts() -> None:
    c = levers.cell("10b", 2048)
    r = c["ratios"]
    assert r["async recv"] > r["now"] and r["opt spread"] > r["now"]
    assert r["async+spread"] > max(r["async recv"], r["opt spread"])
    # cutting idle time cannot pass the zero-idle ceiling; only the recompute cut changes the work
    assert max(r["async+spread"], r["head fused"]) < r["ceiling"]
    assert c["link_over_recompute"] > 1.0  # a block's activations take longer on the link than to recompute


def test_async_receives_wait_right_before_the_reader() -> None:
    sched, _ = levers.plan("10b", 2048, "mobius")
    ops = levers.async_receives(sched).ops[1]
    recvs = [i for i, op in enumerate(ops) if op.kind == levers.OpKind.RECV_ACT]
    assert recvs and all(ops[i].is_async for i in recvs)
    for i, op in enumerate(ops):
        if op.kind == levers.OpKind.WAIT_CKPT and op.sub < 0:
            assert ops[i + 1] == levers.Op(levers.OpKind.FORWARD, op.stage + 1, -1, op.mb)
