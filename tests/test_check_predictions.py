"""The prediction check's verdict (``profiling/check_predictions.py``, issue 27, point 3): medians
over a row's runs against the bounds, the measured side's spread, and ``--report`` over saved runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "profiling" / "check_predictions.py"


@pytest.fixture
def check(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_predictions", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "check_predictions", module)
    spec.loader.exec_module(module)
    return module


def run(name: str, predicted: float, measured: float, host_error: float = 1.0, at: str = "abc") -> dict[str, Any]:
    """One run's JSON line as the check writes it (time error as ``prediction.compare`` computes it)."""
    return {
        "name": name,
        "commit": at,
        "prediction": {
            "iteration_s": {
                "predicted": predicted,
                "measured": measured,
                "error_pct": 100.0 * (measured - predicted) / predicted,
            },
            "peak_host_bytes": {"predicted": 100.0, "measured": 100.0 + host_error, "error_pct": host_error},
        },
    }


def test_the_verdict_is_each_rows_median_not_its_worst_run(check: ModuleType) -> None:
    # tiny:2: one run 30% off, the median 2% off; single:tiny: a median 12% off
    rows = [run("tiny:2", 1.0, m) for m in (1.02, 1.30, 0.99)]
    rows += [run("single:tiny", 1.0, m) for m in (1.12, 1.15, 1.05)]
    out = check.medians_out(rows)
    assert out == ["single:tiny: time +12.0% (bound 10%)"]
    rows[-1]["prediction"]["peak_host_bytes"]["error_pct"] = -40.0
    rows[-2]["prediction"]["peak_host_bytes"]["error_pct"] = -20.0
    assert check.medians_out(rows)[-1] == "single:tiny: host -20.0% (bound 15%)"


def test_measured_cv_is_the_machines_side_alone(check: ModuleType) -> None:
    # the same measured times under two predictions: the cv does not see the prediction
    times = (0.8, 1.0, 1.2)
    a = [run("tiny:4", 1.0, m) for m in times]
    b = [run("tiny:4", 2.0, m) for m in times]
    assert check.measured_cv(a, "tiny:4") == pytest.approx(check.measured_cv(b, "tiny:4"))
    assert check.measured_cv(a, "tiny:4") == pytest.approx((2 / 3) ** 0.5 * 0.2)
    assert check.measured_cv(a[:1], "tiny:4") is None
    failed = {"name": "tiny:4", "error": "rc 1"}
    assert check.measured_cv([*a, failed], "tiny:4") == pytest.approx(check.measured_cv(a, "tiny:4"))
    table = check.spread(a)
    assert "| measured cv |" in table.splitlines()[0]
    assert table.splitlines()[2].split(" | ")[5] == "0.163"


def test_report_judges_saved_runs_of_one_commit(
    check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(run("50M:2", 1.0, m)) + "\n" for m in (1.01, 1.03)))
    # a later commit's runs, 20% slow: judged alone they fail, and --commit keeps them apart
    second.write_text("\n".join(json.dumps(run("50M:2", 1.0, 1.2, at="def")) for _ in range(3)) + "\n")
    assert check.main(["--report", str(first)]) == 0
    assert check.main(["--report", str(first), str(second), "--commit", "abc"]) == 0
    assert check.main(["--report", str(first), str(second), "--commit", "def"]) == 1
    assert check.main(["--report", str(first), str(second)]) == 1  # five runs, median +20%
    out = capsys.readouterr().out
    assert "5 runs from 2 file(s), commits: abc, def" in out
    assert "50M:2: time +20.0% (bound 10%)" in out
    with pytest.raises(SystemExit, match="no runs in .* of commit xyz"):
        check.main(["--report", str(first), "--commit", "xyz"])
    first.write_text("{not json\n")
    with pytest.raises(SystemExit, match=r"a.jsonl:1 is not a JSON line"):
        check.main(["--report", str(first)])


def test_commit_names_the_checkout(check: ModuleType) -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=SCRIPT.parent, capture_output=True, text=True)
    if head.returncode != 0:  # a copy without git history: the lines say so
        assert check.commit() == "unknown"
        return
    assert check.commit().rstrip("+") == head.stdout.strip()[:12]


def test_step_spread_is_the_measured_steps_own(check: ModuleType, tmp_path: Path) -> None:
    """A run's min, median and max step over the steps its prediction measured, not the warm-up's
    or the steps after the window; nothing when the run logged none of them."""
    metrics = tmp_path / "metrics.jsonl"
    times = {0: 9.0, 1: 0.20, 2: 0.10, 3: 0.40, 4: 0.30, 5: 7.0}
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0, "step_time_s": t}) + "\n" for s, t in times.items()))
    assert check.step_spread(metrics, [1, 4]) == {"min": 0.10, "median": 0.25, "max": 0.40}
    assert check.step_spread(metrics, [7, 9]) is None
    assert check.step_spread(tmp_path / "none.jsonl", [1, 4]) is None
