"""`sysx-train` end to end: a short run lowers the loss and writes run_dir; logging; launch rules."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sysx.config import from_yaml, load_config
from sysx.metrics import METRICS_FILE, RunLogger, StepResult
from sysx.run_dir import CONFIG_FILE
from sysx.train import main

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
SHORT = [
    "train.steps=30",
    "train.seq_len=64",
    "train.micro_batch_size=8",
    "train.micro_batches=2",
    "optim.warmup_steps=5",
    "log.every=10",
    "eval.every=15",
    "eval.batches=2",
    "device=cpu",
]
REQUIRED = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "skipped",
    "scale",
    "tokens_per_s",
    "step_time_s",
    "peak_device_mem_bytes",
    "peak_host_rss_bytes",
}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def test_short_run_lowers_the_loss_and_writes_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    run_dir = tmp_path / "run"
    assert main([*SHORT, f"run_dir={run_dir}"]) == 0
    assert Path.cwd() == work and list(work.iterdir()) == []  # no chdir, no outputs/, nothing in cwd

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(30))
    assert all(r.keys() >= REQUIRED for r in rows)
    assert all(r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_host_rss_bytes"] > 0 for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 15, 29]
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert first > 5.0 and last < first - 1.5, (first, last)  # byte-level: starts near ln 256 = 5.55

    saved = from_yaml((run_dir / CONFIG_FILE).read_text())
    # schedule=auto and precision=auto are written as what ran
    assert saved == load_config([*SHORT, "schedule=single", "precision=fp32", f"run_dir={run_dir}"])
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 30

    out = capsys.readouterr().out
    assert (
        "schedule=auto -> single (1 process)" in out
        and "schedule=single model=tiny" in out
        and "tokens/step 1024" in out
        and "precision=fp32" in out
    )
    assert "step  0/30 | loss" in out and "step 10/30" in out and "step 29/30" in out and "step 5/30" not in out
    assert "tok/s" in out and "ms/step" in out and "host rss" in out
    assert out.strip().splitlines()[-1].startswith("done: 30 steps | loss ")


def test_python_dash_m_runs_without_creating_outputs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sysx.train",
            "train.steps=2",
            "train.seq_len=16",
            "eval.every=0",
            "device=cpu",
            f"run_dir={run_dir}",
        ],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no outputs/, no .hydra
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", CONFIG_FILE, METRICS_FILE, "summary.json"]
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir()] == [
        "step-00000002"
    ]  # the end always saves
    assert "done: 2 steps" in proc.stdout


def test_reference_refuses_several_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # torchrun's environment
    monkeypatch.setenv("MASTER_PORT", "29597")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert main(["schedule=reference", "train.steps=1", f"run_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err
        if rank == "0":
            assert err.count("\n") == 1 and "schedule=reference runs in 1 process, but 2 were launched" in err
        else:
            assert err == ""  # only rank 0 reports
    assert not (tmp_path / "run").exists()


def test_data_file_without_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A nanoGPT-layout train.bin/val.bin with no metadata file, dtype and vocab size given as keys."""
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, 300, size=20000).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    tokens[:2000].tofile(tmp_path / "val.bin")
    common = [
        "data=file",
        f"data.path={tmp_path / 'train.bin'}",
        "data.dtype=uint16",
        "data.vocab_size=300",
        "train.steps=2",
        "train.seq_len=16",
        "eval.every=1",
        "eval.batches=1",
        "device=cpu",
    ]
    assert main([*common, f"run_dir={tmp_path / 'small'}"]) == 2  # the tiny preset's vocab is 256
    assert "model.vocab_size=256 is too small" in capsys.readouterr().err
    assert main([*common, "model.vocab_size=320", f"run_dir={tmp_path / 'run'}"]) == 0
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 and all("val_loss" in r for r in rows)
    assert main(["data=file", f"data.path={tmp_path / 'missing.bin'}", f"run_dir={tmp_path / 'x'}"]) == 2
    assert "missing.bin" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown without CUDA")
def test_device_cuda_without_cuda_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["device=cuda", "train.steps=1", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "device='cuda' but CUDA is not available" in capsys.readouterr().err


def result(step: int, loss: float = 3.0, **kw: object) -> StepResult:
    values = dict(step=step, loss=loss, lr=1e-3, grad_norm=1.0, skipped=False, scale=1.0, tokens=100, step_time_s=0.5)
    values.update(kw)
    return StepResult(**values)  # type: ignore[arg-type]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_logger_writes_each_step_flushed_and_prints_every_n(tmp_path: Path) -> None:
    out = io.StringIO()
    logger = RunLogger(tmp_path, total_steps=5, every=2, progress=True, device=torch.device("cpu"), stream=out)
    logger.log(result(0, loss=5.5))
    assert json.loads((tmp_path / METRICS_FILE).read_text())["loss"] == 5.5  # on disk before close
    logger.log(result(1, grad_norm=float("inf"), skipped=True, scale=512.0))
    for step in (2, 3, 4):
        logger.log(result(step, loss=2.0))
    summary = logger.close()
    rows = read_metrics(tmp_path)
    assert len(rows) == 5 and rows[1]["grad_norm"] is None and rows[1]["skipped"] is True
    assert rows[0]["tokens_per_s"] == 200.0 and rows[0]["step_time_s"] == 0.5
    lines = out.getvalue().splitlines()
    assert [line.split("|")[0].strip() for line in lines[:-1]] == ["step 0/5", "step 2/5", "step 4/5"]
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()  # not a TTY: plain lines, no bar
    assert summary.first_loss == 5.5 and summary.last_loss == 2.0 and summary.skipped_steps == 1
    assert summary.mean_tokens_per_s == pytest.approx(200.0)
    assert lines[-1].startswith("done: 5 steps | loss 5.5000 -> 2.0000") and "1 skipped" in lines[-1]


def test_an_emulated_run_reports_every_second_in_modelled_time(tmp_path: Path) -> None:
    """Step times of an emulated device are modelled (wall / emulate.time_scale): the total is too, and the line says so."""
    out = io.StringIO()
    logger = RunLogger(
        tmp_path, total_steps=2, every=1, progress=False, device=torch.device("cpu"), stream=out, time_scale=0.001
    )
    for step in range(2):
        logger.log(result(step))  # 0.5 s per step (modelled): 1 ms of wall each at this scale
    summary = logger.close()
    assert summary.clock == "modelled" and summary.wall_time_s is not None
    assert summary.total_time_s == pytest.approx(summary.wall_time_s / 0.001)
    line = out.getvalue().splitlines()[-1]
    assert "train 1.0 s, total " in line and " modelled (emulated: wall / emulate.time_scale 0.001; wall " in line
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["clock"] == "modelled" and saved["total_time_s"] == pytest.approx(summary.total_time_s)
    wall = RunLogger(None, total_steps=1, every=1, progress=False, device=torch.device("cpu"), stream=out)
    assert wall.summary().clock == "wall" and wall.summary().wall_time_s is None


def test_progress_bar_only_on_a_terminal_and_when_enabled(tmp_path: Path) -> None:
    tty = FakeTTY()
    with RunLogger(None, total_steps=3, every=10, progress=True, device=torch.device("cpu"), stream=tty) as logger:
        assert logger._bar is not None
        for step in range(3):
            logger.log(result(step))
        logger.close()
    assert "\r" in tty.getvalue() and "step 0/3" in tty.getvalue()
    off = FakeTTY()
    with RunLogger(None, total_steps=3, every=10, progress=False, device=torch.device("cpu"), stream=off) as logger:
        assert logger._bar is None


def test_disabled_logger_writes_nothing(tmp_path: Path) -> None:
    out = io.StringIO()
    with RunLogger(
        tmp_path, total_steps=2, every=1, progress=True, device=torch.device("cpu"), stream=out, enabled=False
    ) as logger:
        logger.log(result(0))
        logger.close()
    assert out.getvalue() == "" and list(tmp_path.iterdir()) == []


def test_default_job_end_to_end(tmp_path: Path) -> None:
    """The README's main job as ``sysx-train`` runs it (the default configuration, its own process),
    cut to 60 steps: warmup (50 steps) done, the loss falls clearly (byte-level corpus). The full
    500 steps are a benchmark: ``profiling/bench_default_job.py``."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "sysx.train", "train.steps=60", f"run_dir={run_dir}"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr
    defaults = load_config([])
    assert defaults.train.steps == 500 and defaults.optim.warmup_steps == 50
    rows = read_metrics(run_dir)
    assert len(rows) == 60 and [r["step"] for r in rows if "val_loss" in r] == [0, 59]
    assert rows[0]["loss"] > 5.0 and rows[-1]["loss"] < 3.3, (rows[0]["loss"], rows[-1]["loss"])
    assert rows[49]["lr"] == defaults.optim.lr and rows[-1]["lr"] < rows[49]["lr"]  # the cosine phase ran
    assert "schedule=auto -> single (1 process)" in proc.stdout and "step 50/60" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("done: 60 steps")


def test_the_job_trains_with_its_startup_heap_frozen_and_unfreezes_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Full collections walked every object of the job's start (torch, the modules, the config: about
    235,000 in a tiny job) and paused a step for 104-245 ms; run_job keeps them out of the collector
    while it trains (gc.freeze), and gives them back after (a test session runs many jobs)."""
    import gc

    from sysx.trainers.base import Trainer
    from sysx.trainers.job import long_lived_heap

    frozen_while_training: list[int] = []
    run = Trainer.run

    def recording(self: Trainer, *args: object, **kwargs: object) -> object:
        frozen_while_training.append(gc.get_freeze_count())
        return run(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Trainer, "run", recording)
    assert main([*SHORT, "train.steps=2", "eval.every=0", f"run_dir={tmp_path / 'run'}"]) == 0
    assert len(frozen_while_training) == 1 and frozen_while_training[0] > 10_000
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError, match="inside"), long_lived_heap():
        raise RuntimeError("a failure inside")
    assert gc.get_freeze_count() == 0  # given back on the way out of a failure too
