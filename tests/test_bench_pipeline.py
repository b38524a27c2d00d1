"""The emulated benchmark's bookkeeping (no run): layouts in schedule names, the rows kept when a
cell was measured again, and which rows SysX is compared with."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

_SPEC = importlib.util.spec_from_file_location("bench_pipeline", Path(__file__).parents[1] / "profiling" / "bench_pipeline.py")
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def _row(schedule: str, it: float | None, model: str = "llama2_10b", seq: int = 2048) -> dict[str, Any]:
    measured = None if it is None else {"iteration_s": it, "bubble": 0.1, "over_plan": 1.0}
    return {"model": model, "seq": seq, "ranks": 4, "schedule": schedule,
            "report": {"plan": {"iteration_s": it or 1.0, "bubble": 0.1}, "measured": measured,
                       "refused": None if it else "lagged"}}


def test_a_layout_is_read_from_the_schedule_name() -> None:
    assert bench.split_layout("sysx:cfg3@s4d3") == ("sysx:cfg3", (4, 3))
    assert bench.split_layout("mobius@s6") == ("mobius", (6, None))
    assert bench.split_layout("mobius") == ("mobius", (None, None))
    with pytest.raises(ValueError, match="@s<stages per rank>"):
        bench.split_layout("mobius@six")


def test_sysx_is_compared_with_the_baselines_run_the_same_way() -> None:
    rows = [_row("mobius", 12.0), _row("interleaved_1f1b", 13.0), _row("sysx:cfg3", 10.0),
            _row("mobius@s6", 11.0), _row("interleaved_1f1b@s6", 11.5), _row("sysx:cfg3@s4d3", 10.0)]
    lines = bench.table(rows).splitlines()
    default = next(line for line in lines if "| SysX CFG3 |" in line)
    tuned = next(line for line in lines if "SysX CFG3, best layout" in line)
    assert "**1.20x** | **1.30x**" in default and "**1.10x** | **1.15x**" in tuned
    assert "SysX/Mobius (best layouts) 1.10x" in bench.averages(rows)


def test_a_cell_measured_again_keeps_its_measured_row() -> None:
    first, again = _row("mobius", None), _row("mobius", 12.0)
    assert bench._latest([first, again]) == [again] and bench._latest([again, first]) == [again]
