"""The long-sequence what-if study (planner only, one cell): the idle cuts plan a faster step and
stay under the busiest rank's zero-idle ceiling; a block's activations are slower to send than to
recompute."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "long_seq_levers", Path(__file__).parents[1] / "profiling" / "long_seq_levers.py"
)
assert _SPEC is not None and _SPEC.loader is not None
levers = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(levers)


def test_the_idle_cuts_plan_faster_and_stay_under_the_zero_idle_ceiling() -> None:
    c = levers.cell("10b", 2048)
    r = c["ratios"]
    assert r["opt spread"] > r["now"]
    assert max(r["opt spread"], r["head fused"]) < r["ceiling"]
    assert r["no recompute, last round"] > r["opt spread"]  # cutting work, not idle
    assert c["link_over_recompute"] > 1.0


def test_the_head_cut_bound_moves_the_head_without_losing_work() -> None:
    _, splan = levers.plan("10b", 2048, "sysx:cfg3")
    t, cut = splan.table, levers._head_cut(splan.table)
    assert sum(cut.fwd) == pytest.approx(sum(t.fwd))
    assert sum(cut.bwd) == pytest.approx(sum(t.bwd))
    assert max(cut.bwd) < max(t.bwd)  # the Head's sub-stage is a plain one now
    r = levers.cell("10b", 2048)["ratios"]
    assert r["head cut"] > r["now"]
    assert r["head cut + opt spread"] > max(r["head cut"], r["opt spread"])
