"""The metrics backends (``log.backends``, :mod:`sysx.tracking`): TensorBoard and W&B (offline) get
exactly what ``metrics.jsonl`` holds, read back with TensorBoard's own event reader; a resumed run
continues the same TensorBoard directory (no step twice) and the same W&B run; every backend is
closed on every way out; a missing package or a bad name is one line; TFLOP/s and MFU figures."""

from __future__ import annotations

import io
import json
import math
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from sysx.config import ConfigError, load_config
from sysx.config.choices import ASSUMED_HARDWARE
from sysx.machine.peak import peak_flops_per_s
from sysx.metrics import METRICS_FILE, ComputeRate, RunLogger, StepResult
from sysx.model import get_preset
from sysx.model.flops import flops_per_token
from sysx.tracking import TAGS, tagged_scalars
from sysx.tracking.wandb_log import RUN_ID_FILE, resolve_mode
from sysx.train import main
from sysx.trainers.throughput import compute_rate

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = [
    "schedule=reference",
    "model.dim=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=64",
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "eval.every=2",
    "eval.batches=1",
    "device=cpu",
    "log.progress=false",
    "checkpoint.every=2",
]


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B quiet, offline by the config's choice, and its settings and caches kept in the test's folder."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def read_tensorboard(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of ``log_dir`` as TensorBoard shows it (its reader applies purge steps)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected_series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """What a dashboard must show for ``metrics.jsonl``'s rows: each number under its tag, by step."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for tag, value in tagged_scalars(row).items():
            series.setdefault(tag, []).append((row["step"], value))
    return series


def wandb_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "wandb" in " ".join(p.cmdline())]


def test_tensorboard_and_wandb_hold_the_metrics_and_a_resume_continues_both(tmp_path: Path, wandb_env: None) -> None:
    run = tmp_path / "run"
    args = [*TINY, f"run_dir={run}", "log.backends=[jsonl,tensorboard,wandb]", "log.wandb_mode=offline"]
    assert main([*args, "train.steps=4"]) == 0
    run_id = (run / RUN_ID_FILE).read_text().strip()
    # as if the run had died after step 3 with its last checkpoint at step 2: steps 2 and 3 are redone
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    assert main([*args, "train.steps=5"]) == 0
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]

    shown = read_tensorboard(run / "tensorboard")
    expected = expected_series(rows)
    assert {"train/loss", "val/loss", "train/lr", "perf/tokens_per_s", "memory/host_peak_rss_gib"} <= set(shown)
    assert sorted(shown) == sorted(expected)
    for tag, points in expected.items():  # each step once, with the resumed run's value (elapsed_s differs)
        assert [s for s, _ in shown[tag]] == [s for s, _ in points], tag
        assert [v for _, v in shown[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one directory, continued

    assert (run / RUN_ID_FILE).read_text().strip() == run_id  # the same W&B run, continued
    sessions = sorted((run / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(sessions) == 2 and not wandb_children()
    history = b"".join(p.read_bytes() for s in sessions for p in s.glob("run-*.wandb"))
    assert b"train/loss" in history and b"val/loss" in history
    assert all(json.dumps(r["loss"]).encode() in history for r in rows)  # the history's values as logged


def test_a_fresh_start_in_a_used_run_dir_hides_the_old_tensorboard_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*TINY, f"run_dir={run}", "log.backends=[tensorboard]", "checkpoint.every=0", "eval.every=0"]
    assert main([*args, "train.steps=3", "optim.lr=0.01"]) == 0
    assert main([*args, "train.steps=2", "train.resume=none"]) == 0
    assert not (run / METRICS_FILE).exists()  # jsonl not asked for
    lr = read_tensorboard(run / "tensorboard")["train/lr"]
    assert [s for s, _ in lr] == [0, 1] and lr[1][1] == pytest.approx(4e-5)  # the second run's warmup lr


class Recorder:
    """A backend that notes what it is given and how it is closed."""

    def __init__(self) -> None:
        self.where = "recorder"
        self.records: list[Mapping[str, Any]] = []
        self.closed: list[bool] = []

    def write(self, record: Mapping[str, Any]) -> None:
        self.records.append(record)

    def close(self, *, failed: bool = False) -> None:
        self.closed.append(failed)


def result(step: int, **kw: Any) -> StepResult:
    base = dict(loss=4.0, lr=1e-3, grad_norm=1.0, skipped=False, scale=1.0, tokens=100, step_time_s=0.5)
    return StepResult(step=step, **{**base, **kw})  # type: ignore[arg-type]


def logger_with(backend: Recorder, **kw: Any) -> RunLogger:
    return RunLogger(
        None,
        total_steps=3,
        every=1,
        progress=False,
        device=torch.device("cpu"),
        stream=io.StringIO(),
        backends=[backend],
        **kw,
    )


def test_every_backend_is_closed_on_every_way_out() -> None:
    done, failed, stopped = Recorder(), Recorder(), Recorder()
    with logger_with(done) as logger:
        logger.log(result(0))
        logger.close()
    with pytest.raises(RuntimeError), logger_with(failed) as logger:
        raise RuntimeError("a step failed")
    with pytest.raises(KeyboardInterrupt), logger_with(stopped) as logger:
        raise KeyboardInterrupt
    logger.close(stopped="SIGINT")  # the job's stop path closes again: nothing twice
    assert done.closed == [False] and failed.closed == [True] and stopped.closed == [True]
    assert len(done.records) == 1 and done.records[0]["loss"] == 4.0


def test_a_failing_job_closes_its_tensorboard_and_wandb_runs(
    tmp_path: Path, wandb_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sysx.tracking.tensorboard_log import TensorBoardBackend
    from sysx.trainers.reference import ReferenceTrainer

    closed: list[bool] = []
    real_close, real_step = TensorBoardBackend.close, ReferenceTrainer.train_step

    def close(self: TensorBoardBackend, *, failed: bool = False) -> None:
        closed.append(failed)
        real_close(self, failed=failed)

    def train_step(self: ReferenceTrainer) -> StepResult:
        if self.step_index == 2:
            raise RuntimeError("injected: step 2 failed")
        return real_step(self)

    monkeypatch.setattr(TensorBoardBackend, "close", close)
    monkeypatch.setattr(ReferenceTrainer, "train_step", train_step)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected"):
        main(
            [
                *TINY,
                f"run_dir={run}",
                "train.steps=4",
                "log.backends=[jsonl,tensorboard,wandb]",
                "log.wandb_mode=offline",
            ]
        )
    assert closed == [True] and not wandb_children()
    assert [s for s, _ in read_tensorboard(run / "tensorboard")["train/loss"]] == [0, 1]


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_a_missing_package_is_one_line_naming_the_extra(
    package: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # `import tensorboard` now fails as if not installed
    run = tmp_path / "run"
    assert main([*TINY, f"run_dir={run}", "train.steps=1", f"log.backends=[jsonl,{package}]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"sysx-train: error: log.backends contains {package} but the {package} package is not installed; "
        f"pip install 'sysx[{package}]'"
    )
    assert not run.exists()  # refused before anything was written


def test_wandb_online_without_a_login_is_one_line_naming_offline(
    tmp_path: Path, wandb_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    args = [*TINY, f"run_dir={tmp_path / 'run'}", "train.steps=1", "log.backends=[wandb]", "log.wandb_mode=online"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sysx-train: error: log.backends contains wandb but wandb.init (online) failed: ")
    assert "\n" not in err and err.endswith(
        "set log.wandb_mode=offline to log without a network, or fix the W&B login (wandb login)"
    )
    assert not wandb_children()


@pytest.mark.parametrize(
    "override,expect",
    [
        (
            "log.backends=[jsonl,tb]",
            "log.backends=[jsonl,tb] is not valid: tb is unknown; allowed: jsonl, tensorboard, wandb",
        ),
        ("log.backends=[wandb,wandb]", "log.backends=[wandb,wandb] is not valid: wandb is given twice"),
        ("log.wandb_mode=cloud", "log.wandb_mode=cloud is not valid: allowed: auto, offline, online"),
    ],
)
def test_a_bad_backend_setting_is_one_line(override: str, expect: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert str(err.value).startswith(expect) and "\n" not in str(err.value)


def test_wandb_mode_auto_logs_online_only_with_a_key(tmp_path: Path) -> None:
    none = {"NETRC": str(tmp_path / "absent")}
    assert resolve_mode("auto", none) == "offline"
    assert resolve_mode("auto", {**none, "WANDB_API_KEY": "k" * 40}) == "online"
    assert resolve_mode("auto", {**none, "WANDB_MODE": "disabled"}) == "disabled"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert resolve_mode("auto", {"NETRC": str(netrc)}) == "online"
    assert resolve_mode("auto", {"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.org"}) == "offline"
    assert resolve_mode("offline", {"WANDB_API_KEY": "k"}) == "offline"


def test_every_number_of_a_record_has_its_tag_and_tflops_and_mfu_are_per_device() -> None:
    rec = Recorder()
    out = io.StringIO()
    logger = RunLogger(
        None,
        total_steps=1,
        every=1,
        progress=False,
        device=torch.device("cpu"),
        stream=out,
        backends=[rec],
        compute=ComputeRate(flops_per_step=4e12, devices=2, peak_flops_per_s=8e12),
    )
    full = dict(val_loss=3.0, checkpoint_stall_s=0.1, speculated=True, rolled_back=1, restepped=0, opt_exposed_s=0.2)
    logger.log(result(0, grad_norm=math.inf, **full))
    record = rec.records[0]
    assert set(record) - {"step"} <= set(TAGS)  # a new field needs its tag
    assert record["tflops"] == pytest.approx(4.0) and record["mfu"] == pytest.approx(0.5)  # 4e12 / 0.5 s / 2
    scalars = tagged_scalars(record)
    assert "train/grad_norm" not in scalars  # null in metrics.jsonl, no point on a dashboard
    assert scalars["optim/speculated"] == 1.0 and scalars["perf/mfu"] == pytest.approx(0.5)
    assert scalars["memory/host_peak_rss_gib"] == pytest.approx(record["peak_host_rss_bytes"] / 1024**3)
    assert "4 TFLOP/s (MFU 50.0%)" in out.getvalue()


def test_compute_rate_on_an_emulated_gpu_uses_the_emulated_model_and_peak() -> None:
    cfg = load_config(["device=emulated", "schedule=sysx", "train.seq_len=64", "emulate.micro_batch_size=4"])
    rate = compute_rate(cfg, get_preset("tiny"), torch.device("cpu"), devices=4)
    assert rate is not None and rate.devices == 4
    tokens = cfg.train.micro_batches * 4 * 64
    assert rate.flops_per_step == flops_per_token(get_preset(cfg.emulate.model), 64) * tokens
    assert rate.peak_flops_per_s == ASSUMED_HARDWARE[cfg.emulate.gpu]["peak_tflops"] * 1e12
    on_cpu = load_config(["device=cpu"])
    assert compute_rate(on_cpu, get_preset("tiny"), torch.device("cpu"), devices=1) is None


def test_compute_rate_on_a_gpu_uses_the_job_model_and_the_gpus_datasheet_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    cfg = load_config(["train.seq_len=64", "train.micro_batch_size=4", "train.micro_batches=3"])
    model = get_preset("tiny")
    rate = compute_rate(cfg, model, torch.device("cuda", 0), devices=1)
    assert rate is not None and rate.peak_flops_per_s == 756e12
    assert rate.flops_per_step == flops_per_token(model, 64) * 3 * 4 * 64
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU nobody listed")
    unknown = compute_rate(cfg, model, torch.device("cuda", 0), devices=1)
    assert unknown is not None and unknown.peak_flops_per_s is None  # TFLOP/s, but no MFU from a guess


@pytest.mark.parametrize(
    "name,tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("Tesla V100-PCIE-32GB", 112.0),
        ("NVIDIA GeForce RTX 4090", 165.0),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_a_gpus_peak_by_its_name(name: str, tflops: float | None) -> None:
    assert peak_flops_per_s(name) == (None if tflops is None else tflops * 1e12)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_only_rank_0_of_a_pipeline_writes_the_backends(tmp_path: Path) -> None:
    from test_runtime_procs import LAUNCH_ARGS, launch

    run = tmp_path / "run"
    argv = [sys.executable, "-m", "sysx.train", *LAUNCH_ARGS, "schedule=gpipe", f"run_dir={run}"]
    argv += ["log.backends=[jsonl,tensorboard,wandb]", "log.wandb_mode=offline"]
    home = tmp_path / "wandb-home"
    done = launch(argv, 2, 2, timeout=100, WANDB_SILENT="true", WANDB_CONFIG_DIR=str(home), WANDB_CACHE_DIR=str(home))
    assert [p.returncode for p in done] == [0, 0], done[1].stderr[-2000:]
    assert len(list((run / "tensorboard").iterdir())) == 1  # one event file: rank 1 opened no writer
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1
    rows = read_metrics(run)
    loss = read_tensorboard(run / "tensorboard")["train/loss"]
    assert [s for s, _ in loss] == [r["step"] for r in rows] == [0, 1, 2]
    assert [v for _, v in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
