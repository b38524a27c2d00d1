"""The single-GPU benchmark script runs end to end on the tiny model on the CPU (one step each)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "profiling" / "bench_single.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rows; the GPU run is the benchmark itself")
def test_bench_single_tiny_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("bench_single", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_single", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    rows = bench.main(
        [
            "--model",
            "tiny",
            "--seq-len",
            "64",
            "--micro-batch-size",
            "2",
            "--micro-batches",
            "2",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--budgets-gb",
            "1",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert text.startswith("Command: `PYTHONPATH=. python profiling/bench_single.py --model tiny")
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in table[1:]] == ["sysx single", "pytorch ckpt", "zero3 offload"]
    by_method = {r.method: r for r in rows}
    assert by_method["sysx single"].tokens_per_s > 0 and by_method["pytorch ckpt"].tokens_per_s > 0
    assert by_method["zero3 offload"].note == "needs CUDA" and by_method["zero3 offload"].tokens_per_s is None
    assert all(r.mfu is None and r.peak_gib is None for r in rows)  # CPU: "-"
    assert [r["method"] for r in json.loads(out.read_text())] == ["sysx single", "pytorch ckpt", "zero3 offload"]
