"""The long-sequence what-if study (planner only, one cell): the idle cuts plan a faster step and
stay under the busiest rank's zero-idle ceiling; a block's activations are slower to send than to
recompute."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
