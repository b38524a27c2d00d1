"""The emulated benchmark's bookkeeping (no run): layouts in schedule names, the rows kept when a
cell was measured again, and which rows SysX is compared with."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_pipeline", Path(__file__).parents[1] / "profiling" / "bench_pipeline.py"
)
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def _row(schedule: str, it: float | None, model: str = "llama2_10b", seq: int = 2048) -> dict[str, Any]:
    measured = None if it is None else {"iteration_s": it, "bubble": 0.1, "over_plan": 1.0}
    return {
        "model": model,
        "seq": seq,
        "ranks": 4,
        "schedule": schedule,
        "report": {
            "plan": {"iteration_s": it or 1.0, "bubble": 0.1},
            "measured": measured,
            "refused": None if it else "lagged",
        },
    }


def test_a_layout_is_read_from_the_schedule_name() -> None:
    assert bench.split_layout("sysx:cfg3@s4d3") == ("sysx:cfg3", (4, 3))
    assert bench.split_layout("mobius@s6") == ("mobius", (6, None))
    assert bench.split_layout("mobius") == ("mobius", (None, None))
    # SysX's default, a block per stage, picked as a best layout: a chosen layout, built by the rule
    assert bench.split_layout("sysx:cfg3@blocks") == ("sysx:cfg3", (bench.BLOCKS, None))
    assert bench._family("sysx:cfg3@blocks") == ("sysx:cfg3", True)
    assert bench._label("sysx:cfg3@blocks") == "SysX CFG3, best layout: a block per stage, d=1"
    with pytest.raises(ValueError, match="@s<stages per rank>"):
        bench.split_layout("mobius@six")


def test_sysx_is_compared_with_the_baselines_run_the_same_way() -> None:
    rows = [
        _row("mobius", 12.0),
        _row("interleaved_1f1b", 13.0),
        _row("sysx:cfg3", 10.0),
        _row("mobius@s6", 11.0),
        _row("interleaved_1f1b@s6", 11.5),
        _row("sysx:cfg3@s4d3", 10.0),
    ]
    lines = bench.table(rows).splitlines()
    default = next(line for line in lines if "| SysX CFG3 |" in line)
    tuned = next(line for line in lines if "SysX CFG3, best layout" in line)
    assert "**1.20x** | **1.30x**" in default and "**1.10x** | **1.15x**" in tuned
    assert "SysX/Mobius (best layouts) 1.10x" in bench.averages(rows)


def test_a_default_sysx_row_names_its_split_and_stages_per_rank_unless_two() -> None:
    assert bench._label("sysx:cfg3", {**_row("sysx:cfg3", 10.0), "nsf": 16, "split": 3}) == (
        "SysX CFG3 (4 stages/rank, d=3)"
    )
    assert bench._label("sysx:cfg3", {**_row("sysx:cfg3", 10.0), "nsf": 8, "split": 3}) == "SysX CFG3 (d=3)"
    assert bench._label("sysx:cfg3", {**_row("sysx:cfg3", 10.0), "split": 3}) == "SysX CFG3 (d=3)"  # older rows
    assert bench._label("sysx:cfg3", {**_row("sysx:cfg3", 10.0), "nsf": 97, "split": 1}) == (
        "SysX CFG3 (a block per stage, d=1)"
    )


def test_a_cell_measured_again_keeps_its_measured_row() -> None:
    first, again = _row("mobius", None), _row("mobius", 12.0)
    assert bench._latest([first, again]) == [again] and bench._latest([again, first]) == [again]


def test_the_tuned_row_is_compared_with_its_prediction_and_the_best_fixed_layout() -> None:
    rows = [
        _row("mobius", 12.0),
        _row("sysx:cfg3", 11.0),
        _row("sysx:cfg3@s4d3", 10.5),
        {**_row("sysx:tuned", 10.0), "choice": "stages/rank 4 d=3"},
    ]
    rows[-1]["report"]["plan"]["iteration_s"] = 9.9
    line = bench.tuned_lines(rows)
    assert "tuned 10.00 s measured vs 9.90 s predicted (+1.0%)" in line
    assert "best fixed layout SysX CFG3, best layout: 4 stages/rank, d=3 10.50 s: tuned/best 0.952" in line
    assert "| SysX tuned (stages/rank 4 d=3) |" in bench.table(rows)


def test_a_sysx_schedule_names_its_placement() -> None:
    assert bench.split_placement("sysx:cfg3+split") == ("sysx:cfg3", "split")
    assert bench.split_placement("sysx:cfg3+cpu@s4d3") == ("sysx:cfg3@s4d3", "cpu")
    assert bench.split_placement("sysx:cfg3@s4d3+split") == ("sysx:cfg3@s4d3", "split")
    assert bench.split_placement("mobius@s6") == ("mobius@s6", None)
    assert bench.split_layout("sysx:cfg3+split@s4d3") == ("sysx:cfg3", (4, 3))  # the layout reads through it
    for bad in ("sysx:cfg3+gpu", "mobius+split", "sysx:cfg3+cpu+split"):
        with pytest.raises(ValueError, match="bad placement"):
            bench.split_placement(bad)
    assert bench.parse_schedules("mobius, sysx:cfg3+cpu", "cpu,split") == ["mobius", "sysx:cfg3+cpu", "sysx:cfg3+split"]
    with pytest.raises(ValueError, match="unknown placement 'gpu'"):
        bench.parse_schedules("mobius", "gpu")


def _placed(schedule: str, it: float, plan: float, on: list[int], *, gpu: str = "h100") -> dict[str, Any]:
    """A measured row at a placement: ``on[r]`` of rank r's 6 sub-stages on the device."""
    row = {**_row(schedule, it), "gpu": gpu, "split": 3}
    row["report"]["plan"]["iteration_s"] = plan
    ranks = [
        {
            "device": [f"s{i}.0" for i in range(n)],
            "units": 6,
            "device_params": n,
            "params": 6,
            "cpu_finish_s": 3.3,
            "finish_s": 3.3 - 0.4 * n,
            "saving_s": 0.4 * n,
        }
        for n in on
    ]
    row["placement"] = {"mode": bench.split_placement(schedule)[1] or "auto", "ranks": ranks}
    return row


def test_placement_rows_are_labelled_and_compared_with_their_cpu_sibling() -> None:
    rows = [
        {**_row("mobius", 6.0), "gpu": "h100"},
        _placed("sysx:cfg3", 2.2, 2.1, [3, 3]),
        {**_row("sysx:cfg3+cpu", 4.0), "gpu": "h100", "split": 3, "placement": {"mode": "cpu"}},
        _placed("sysx:cfg3+split", 2.0, 2.07, [5, 4]),
    ]
    rows[2]["report"]["plan"]["iteration_s"] = 3.3
    lines = bench.table(rows).splitlines()
    assert "vs optim.placement=cpu" in lines[0] and lines[1].count("---") == 12
    split = next(line for line in lines if "+split" in line or "placement=split" in line)
    assert (
        "| 10B on H100 | 2048 | 4 | SysX CFG3 (d=3), optim.placement=split: 9 of 12 sub-stages on the device |" in split
    )
    # 4.0 / 2.0 measured; the plan 3.30 -> 2.07; the model: the slowest rank's end, 3.3 -> 3.3 - 4 x 0.4
    assert split.endswith("|  |  | **2.00x** (-2.00 s; plan -1.23 s, model -1.60 s) |")
    default = next(line for line in lines if "placement=auto" in line)
    assert "SysX CFG3 (d=3), optim.placement=auto: 6 of 12 sub-stages on the device |" in default
    assert "| **2.73x** | - | **1.82x** (-1.80 s" in default  # SysX/Mobius stays on the default row
    cpu = next(line for line in lines if "placement=cpu |" in line)
    assert cpu.endswith("| 4.00 | 10.0% | 3.30 | 10.0% | 1.000 |  |  |  |")
    assert bench.averages(rows) == "SysX/Mobius 2.73x on average (2.73-2.73, 1 rows)"
    v100 = [{**_row("mobius", 14.0), "gpu": "v100"}, {**_row("sysx:cfg3", 10.0), "gpu": "v100"}]
    assert bench.averages(rows + v100) == (
        "SysX/Mobius on H100 2.73x on average (2.73-2.73, 1 rows); "
        "SysX/Mobius on V100 1.40x on average (1.40-1.40, 1 rows)"
    )


def test_the_planned_column_says_when_it_has_the_device_lane() -> None:
    row = _placed("sysx:cfg3+split", 2.0, 2.07, [5])
    row["report"]["plan"]["cpu_lane_iteration_s"] = 3.3
    assert "| 2.07 (CPU lane alone 3.30) |" in bench.table([row])
    assert "vs optim.placement=cpu" not in bench.table([_row("sysx:cfg3", 2.0)])  # no placement row: no column
    same = [{**_row("sysx:cfg3+cpu", 10.9), "gpu": "h100"}, _placed("sysx:cfg3+split", 10.899, 1.0, [0])]
    same[0]["report"]["plan"]["iteration_s"] = 1.0
    assert "| **1.00x** (0.00 s; plan 0.00 s, model 0.00 s) |" in bench.table(same)  # nothing moved: no "-0.00"
