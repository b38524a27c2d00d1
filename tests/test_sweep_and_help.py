"""``sysx-train -m`` (a Hydra-style sweep of single-process jobs) and ``--help``'s one line per key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sysx.data import TokenWriter

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_a_sweep_runs_every_point_in_its_own_run_dir(tmp_path: Path) -> None:
    """A good point and one that fails at run time: each gets <run_dir>/<n>, a summary line, exit 1
    (the README's 2 x 2 sweep, run by tests/test_readme.py, shows a grid's points in order)."""
    with TokenWriter(tmp_path / "tokens.bin", vocab_size=256, tokenizer={"kind": "byte"}) as w:
        w.write(np.random.default_rng(0).integers(0, 256, size=5000).astype(np.uint16))
        w.finish(val_fraction=0.0)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    args = ["schedule=reference", "device=cpu", "model.n_layers=1", "train.seq_len=16", "train.micro_batch_size=2"]
    args += ["eval.every=0", "log.progress=false", "data=file", f"run_dir={tmp_path / 'sweep'}"]
    good, missing = tmp_path / "tokens.bin", tmp_path / "missing.bin"
    proc = subprocess.run(
        [sys.executable, "-m", "sysx.train", "-m", *args, "train.steps=1", f"data.path={good},{missing}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=560,
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr
    summary = [
        line for line in proc.stdout.splitlines() if line.startswith("sysx-train: sweep point ") and ": " in line
    ]
    ends = [line for line in summary if " of " not in line]
    assert ends == [
        f"sysx-train: sweep point 0: ok: data.path={good} run_dir={tmp_path / 'sweep' / '0'}",
        f"sysx-train: sweep point 1: failed (exit 2): data.path={missing} run_dir={tmp_path / 'sweep' / '1'}",
    ], proc.stdout
    assert "sweep: 1 of 2 points failed" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "sweep" / "0" / "metrics.jsonl").is_file()
    assert not (tmp_path / "sweep" / "1").exists()


def test_help_describes_every_key_in_one_line() -> None:
    from sysx.config.describe import key_descriptions
    from sysx.train import help_text

    docs = key_descriptions()
    assert all(docs.values()), [key for key, text in docs.items() if not text]
    text = help_text(["train.steps=7"])
    lines = text.split("configuration (", 1)[1].splitlines()[1:]
    assert len(lines) == len(docs)
    assert any(line.split() == ["train.steps=7", "optimizer", "steps"] for line in lines), lines
    assert all(len(line.split(None, 1)) == 2 for line in lines)
