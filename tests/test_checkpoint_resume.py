"""Resume is exact: N steps straight equal N/2 steps, a checkpoint, a fresh trainer and N/2 more
(losses, gradient norms, parameters, bit for bit), for the reference loop and the sliding window
in fp32 and in fp16 with dynamic loss scaling; a checkpoint of one trainer continues in another;
a checkpoint of another model is refused with one line naming both values."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from sysx.checkpoint import Checkpoint
from sysx.config import (
    CheckpointSection,
    ConfigError,
    EvalSection,
    LossScaleSection,
    ModelSection,
    OptimSection,
    SingleSection,
    SysxConfig,
    TrainSection,
)
from sysx.single.hardware import assumed_hardware
from sysx.trainers import checkpointing
from sysx.trainers.checkpointing import JobCheckpoints
from sysx.trainers.reference import ReferenceTrainer
from sysx.trainers.single import SingleTrainer

STEPS = 6
HW = assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=8)
# fp16: a scale that grows every 2 clean steps and then overflows, so the scaler's state
# (scale, good-step count, skipped steps) changes on both sides of the checkpoint.
FP16_SCALE = LossScaleSection(init=2.0**16, growth_interval=2)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_cfg(tmp_path: Path, precision: str, **train) -> SysxConfig:
    return SysxConfig(
        model=ModelSection(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64),
        train=TrainSection(steps=STEPS, micro_batch_size=2, micro_batches=2, seq_len=16, **train),
        optim=OptimSection(lr=1e-3, warmup_steps=2, grad_clip=0.5),
        eval=EvalSection(every=0),
        loss_scale=FP16_SCALE if precision == "fp16" else LossScaleSection(),
        precision=precision,
        device="cpu",
        checkpoint=CheckpointSection(dir=str(tmp_path / "ckpt")),
        run_dir=str(tmp_path / "run"),
    )


def make_trainer(kind: str, cfg: SysxConfig):
    if kind == "reference":
        return ReferenceTrainer(cfg)
    single = SingleSection(window=2, micro_batch_size=1, round_sequences=2, policy="input", print_plan=False)
    return SingleTrainer(cfg, single=single, hardware=HW)


def straight_and_resumed(
    kind: str, cfg: SysxConfig, resume_kind: str | None = None, split_cfg: SysxConfig | None = None
):
    """``split_cfg``: the split run's configuration, when it differs (the NVMe tier against host memory)."""
    with make_trainer(kind, cfg) as t:
        straight = t.run(STEPS)
        straight_state = t.state_dict()
    cfg = split_cfg or cfg
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=cfg.checkpoint.dir + "-split"))
    with make_trainer(kind, cfg) as t:
        first = t.run(STEPS // 2)
        ckpts = JobCheckpoints(t)
        t0 = time.perf_counter()
        stall = ckpts.save().stall_s
        assert 0 <= stall <= time.perf_counter() - t0  # the loop stalls inside save(), never longer
        ckpts.close()
    with make_trainer(resume_kind or kind, cfg) as t:
        ckpts = JobCheckpoints(t)
        assert ckpts.resume() is not None and t.step_index == STEPS // 2
        second = t.run(STEPS - STEPS // 2)
        state = t.state_dict()
        ckpts.close()
    return straight, straight_state, first + second, state


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["reference", "single"])
def test_resume_is_bit_identical(tmp_path: Path, kind: str, precision: str) -> None:
    straight, straight_state, resumed, state = straight_and_resumed(kind, make_cfg(tmp_path, precision))
    assert [r.step for r in resumed] == list(range(STEPS))
    # repr: exact for floats, and nan (an overflowed fp16 step's norm) equals itself
    assert [repr(r.loss) for r in resumed] == [repr(r.loss) for r in straight]
    assert [repr(r.grad_norm) for r in resumed] == [repr(r.grad_norm) for r in straight]
    assert [(r.skipped, r.scale) for r in resumed] == [(r.skipped, r.scale) for r in straight]
    if precision == "fp16":
        assert any(r.skipped for r in straight) and len({r.scale for r in straight}) > 1  # the scaler did move
    assert state.keys() == straight_state.keys()
    assert all(torch.equal(state[k], straight_state[k]) for k in state)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_with_the_nvme_tier_is_bit_identical_to_host_memory(
    tmp_path: Path, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved from the tier's state files (streamed) and restored into them: the run equals the
    host-memory run bit for bit, and its checkpoint holds the host run's tensors bit for bit."""
    calls: list[str] = []
    for name in ("tier_layer_sources", "restore_flat"):
        real = getattr(checkpointing, name)
        monkeypatch.setattr(checkpointing, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    host = make_cfg(tmp_path, precision)
    (tmp_path / "nvme").mkdir()
    optim = dataclasses.replace(host.optim, offload="nvme", nvme_dir=str(tmp_path / "nvme"), nvme_engine="threads")
    tier = dataclasses.replace(host, optim=optim)
    straight, straight_state, resumed, state = straight_and_resumed("single", host, split_cfg=tier)
    assert [repr(r.loss) for r in resumed] == [repr(r.loss) for r in straight]
    assert [repr(r.grad_norm) for r in resumed] == [repr(r.grad_norm) for r in straight]
    assert [(r.skipped, r.scale) for r in resumed] == [(r.skipped, r.scale) for r in straight]
    assert all(torch.equal(state[k], straight_state[k]) for k in straight_state)
    with make_trainer("single", dataclasses.replace(host, checkpoint=CheckpointSection(dir=str(tmp_path / "h")))) as t:
        t.run(STEPS // 2)
        JobCheckpoints(t).save(background=False)
    saved_host, saved_tier = (Checkpoint(tmp_path / d / f"step-{STEPS // 2:08d}") for d in ("h", "ckpt-split"))
    for i in range(host.model.n_layers + 2):
        a, b = saved_host.layer(i), saved_tier.layer(i)
        assert a.step == b.step
        for kind in ("weight", "exp_avg", "exp_avg_sq"):
            x, y = getattr(a, kind), getattr(b, kind)
            assert x.keys() == y.keys() and all(torch.equal(x[n].view(torch.int32), y[n].view(torch.int32)) for n in x)
    assert list((tmp_path / "nvme").iterdir()) == []  # every trainer removed its state files
    assert {"tier_layer_sources", "restore_flat"} <= set(calls)  # the streamed paths, not a resident copy


def test_a_window_checkpoint_continues_in_the_reference_loop(tmp_path: Path) -> None:
    """Shards are keyed by layer, so another trainer resumes them; its AdamW arithmetic differs from
    the window's CPU Adam in the last bits, so the continuation is close, not bit-identical."""
    straight, _, resumed, _ = straight_and_resumed("single", make_cfg(tmp_path, "fp32"), resume_kind="reference")
    for a, b in zip(resumed, straight):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)


def test_another_model_is_refused_with_both_values(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, "fp32")
    with make_trainer("reference", cfg) as t:
        t.run(1)
        JobCheckpoints(t).save(background=False)
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dim=64))
    with make_trainer("reference", other) as t, pytest.raises(ConfigError) as err:
        JobCheckpoints(t).resume()
    message = str(err.value)
    assert "\n" not in message and "dim=32" in message and "dim=64" in message and "train.resume=none" in message


def test_the_job_resumes_where_it_stopped_and_keeps_the_earlier_metrics(tmp_path: Path) -> None:
    from sysx.train import main

    args = [
        "schedule=reference",
        "model.dim=32",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.ffn_dim=64",
        "train.seq_len=16",
        "train.micro_batch_size=2",
        "eval.every=0",
        "device=cpu",
        "log.progress=false",
        f"run_dir={tmp_path / 'run'}",
        "checkpoint.every=2",
    ]
    assert main([*args, "train.steps=4"]) == 0  # as if stopped after step 4 of a longer run
    assert main([*args, "train.steps=6"]) == 0  # the same command, longer: resumes at step 4
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(6))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["extra"]["checkpoint"]["last"].endswith("step-00000006")
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.is_dir())
    assert saved == ["step-00000004", "step-00000006"]  # keep=2


def test_a_rerun_of_a_finished_job_says_so_and_changes_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sysx.train import main

    run = tmp_path / "run"
    args = [
        "schedule=reference",
        "model.dim=32",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.ffn_dim=64",
        "train.seq_len=16",
        "train.micro_batch_size=2",
        "train.steps=3",
        "eval.every=0",
        "device=cpu",
        "log.progress=false",
        f"run_dir={run}",
    ]
    assert main(args) == 0
    files = sorted(p for p in run.rglob("*") if p.is_file())
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}
    capsys.readouterr()
    time.sleep(0.01)  # a rewrite would get a later mtime
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "already finished" in out and str(run / "summary.json") in out and "step-00000003" in out
    assert "done:" not in out and "nan" not in out
    assert sorted(p for p in run.rglob("*") if p.is_file()) == files
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files} == before
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
