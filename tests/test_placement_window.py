"""Optimizer placement in the sliding window (``schedule=single``, ``optim.placement``): the model
on the window's timeline, and groups stepped on the device lane ending where the CPU lane ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sysx.config import EvalSection, ModelSection, OptimSection, SingleSection, SysxConfig, TrainSection, validate
from sysx.optim.placement import LaneRates, choose, place
from sysx.single.hardware import assumed_hardware
from sysx.single.lanes import window_units
from sysx.trainers.single import SingleTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

GB, M = 1e9, 1_000_000
STEPS = 4
CLIP = 4.5  # the tiny model's norms over its first steps are 3.2-8.3: some steps clip, some do not
GROUPS = [(f"block{k}", 100 * M) for k in range(8)] + [("embedding+head", 200 * M)]
# an H100 node's figures (50 GB/s each way, 3 TB/s device memory), and a link 200x slower; CPU Adam 0.1
# Gparams/s per worker
FAST = LaneRates(
    cpu_params_per_s=0.1e9,
    cpu_workers=2,
    h2d_bytes_per_s=50 * GB,
    d2h_bytes_per_s=50 * GB,
    device_mem_bytes_per_s=3000 * GB,
)
SLOW = LaneRates(
    cpu_params_per_s=0.1e9,
    cpu_workers=2,
    h2d_bytes_per_s=0.25 * GB,
    d2h_bytes_per_s=0.25 * GB,
    device_mem_bytes_per_s=3000 * GB,
)


def fake_plan(step_s: float = 10.0, fwd: float = 0.3, window: int = 2, rounds: int = 1) -> SimpleNamespace:
    """The plan fields the window's timeline reads."""
    return SimpleNamespace(
        times={"step_s": step_s, "block_fwd_round_s": fwd, "t_grad_s": 0.05}, rounds=rounds, window=window
    )


# ------------------------------------------------------------------------------------- model
def test_the_window_timeline_brings_blocks_home_in_reverse() -> None:
    units, idle = window_units(fake_plan(), GROUPS, speculative=False)  # type: ignore[arg-type]
    ready = {u.name: u.ready for u in units}
    assert idle == 10.0 and ready["embedding+head"] == 10.0
    assert [ready[f"block{k}"] for k in range(8)] == sorted((ready[f"block{k}"] for k in range(8)), reverse=True)
    assert ready["block0"] == pytest.approx(10.05)  # the last block backward ends with the step, then its copy home
    due = {u.name: u.due for u in units}  # the next forward needs block k >= W after block k - W ran
    assert due["embedding+head"] == due["block0"] == due["block1"] == 0.0 and due["block7"] == pytest.approx(6 * 0.3)
    assert all(u.due == 0.0 for u in window_units(fake_plan(), GROUPS, speculative=True)[0])


@pytest.mark.parametrize("speculative", [False, True])
def test_a_fast_device_takes_the_groups_home_last_and_a_slow_one_none(speculative: bool) -> None:
    units, idle = window_units(fake_plan(), GROUPS, speculative=speculative)  # type: ignore[arg-type]
    fast = place(units, FAST, device_idle=idle, speculative=speculative)
    assert {"embedding+head", "block0"} <= set(fast.device) and "block7" not in fast.device
    assert fast.saving > 0.5 and fast.finish < fast.cpu_finish
    slow = place(units, SLOW, device_idle=idle, speculative=speculative)
    assert slow.device == () and slow.saving == 0.0
    assert choose("cpu", units, FAST, device_idle=idle, speculative=speculative).device == ()


def test_a_due_group_late_on_the_cpu_holds_nothing() -> None:
    # validating first, block7 may end 1.8 s after the next forward starts; speculating, it may not
    late, _ = window_units(fake_plan(), GROUPS, speculative=False)  # type: ignore[arg-type]
    now, _ = window_units(fake_plan(), GROUPS, speculative=True)  # type: ignore[arg-type]
    assert (
        place(late, SLOW, device_idle=10.0, speculative=False).finish
        < place(now, SLOW, device_idle=10.0, speculative=False).finish
    )


def test_the_lane_steps_in_lent_bytes_when_they_hold_the_unit() -> None:
    from sysx.optim.cpu_adam import CpuAdam
    from sysx.optim.device_lane import DeviceLane

    n = 3000
    gen = torch.Generator().manual_seed(5)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    host, lane_opt = (CpuAdam(p.clone(), lr=1e-3, weight_decay=0.1, backend="torch") for _ in range(2))
    lent = torch.zeros(5 * n * 4 + 64, dtype=torch.uint8)
    host.step(g, lr=1e-3)
    DeviceLane("cpu", lent).step(lane_opt, g, lr=1e-3)
    assert torch.equal(host.param, lane_opt.param) and torch.equal(host.exp_avg_sq, lane_opt.exp_avg_sq)
    assert torch.equal(lent[: 5 * n * 4].view(torch.float32).view(5, n)[1], host.param)  # p stepped there
    small = DeviceLane("cpu", torch.zeros(16, dtype=torch.uint8))
    small.step(lane_opt, g, lr=1e-3)  # too small: buffers of its own
    host.step(g, lr=1e-3)
    assert torch.equal(host.param, lane_opt.param)


# ------------------------------------------------------------------------------------ trainer
def make_cfg(precision: str, speculate: str, clip: float, placement: str = "cpu") -> SysxConfig:
    cfg = SysxConfig(
        model=ModelSection(preset="tiny"),
        precision=precision,
        train=TrainSection(steps=STEPS, micro_batch_size=2, micro_batches=2, seq_len=16),
        optim=OptimSection(warmup_steps=2, grad_clip=clip, speculate=speculate, placement=placement),
        eval=EvalSection(every=0, batches=2),
        device="cpu",
    )
    validate(cfg)
    return cfg


def window(cfg: SysxConfig, rates: LaneRates | None = None) -> SingleTrainer:
    single = SingleSection(window=2, policy="dp", round_sequences=4, micro_batch_size=2, print_plan=False)
    hw = assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=8)
    return SingleTrainer(cfg, single=single, hardware=hw, optimizer_backend="torch", device="cpu", lane_rates=rates)


def run(cfg: SysxConfig, device_groups: tuple[str, ...] = ()) -> tuple[list, dict[str, torch.Tensor], list]:
    with window(cfg) as trainer:
        if device_groups:
            trainer.use_device_lane(device_groups)
        results = trainer.run(STEPS)
        masters = [g.master.clone() for g in trainer.host.groups] + [g.work.clone() for g in trainer.host.groups]
        return results, trainer.state_dict(), masters


@pytest.mark.parametrize(
    "precision,speculate,clip",
    [("fp32", "never", CLIP), ("bf16", "never", CLIP), ("fp16", "never", CLIP), ("bf16", "always", 0.0)],
)
def test_groups_on_the_device_lane_end_bit_identical_to_the_cpu_lane(
    precision: str, speculate: str, clip: float
) -> None:
    cpu_results, cpu_state, cpu_bufs = run(make_cfg(precision, speculate, clip))
    results, state, bufs = run(make_cfg(precision, speculate, clip), ("embedding+head", "block0"))
    if clip:
        assert any(r.grad_norm > clip for r in results) and any(r.grad_norm <= clip for r in results)
    assert [r.loss for r in results] == [r.loss for r in cpu_results]
    assert [r.grad_norm for r in results] == [r.grad_norm for r in cpu_results]
    assert all(torch.equal(state[k], v) for k, v in cpu_state.items())
    assert all(torch.equal(a, b) for a, b in zip(bufs, cpu_bufs))  # masters and 16-bit working copies


def test_speculating_only_the_cpu_lane_re_steps() -> None:
    _, cpu_state, _ = run(make_cfg("fp32", "never", CLIP))
    results, state, _ = run(make_cfg("fp32", "always", CLIP), ("embedding+head", "block0"))
    rel = max(float((state[k] - v).abs().max() / v.abs().max()) for k, v in cpu_state.items())
    assert rel <= 1e-4, rel  # a clipped step undone and redone: an ulp per step (test_speculate's PARAM_TOL)
    assert all(r.restepped == 3 for r in results if r.grad_norm > CLIP)  # blocks 1-3; the device lane's never


def test_split_runs_the_model_and_prints_the_split_once(capsys: pytest.CaptureFixture[str]) -> None:
    slow_cpu = LaneRates(
        cpu_params_per_s=1e5,
        cpu_workers=2,
        h2d_bytes_per_s=50 * GB,
        d2h_bytes_per_s=50 * GB,
        device_mem_bytes_per_s=3000 * GB,
    )
    with window(make_cfg("bf16", "never", CLIP, "split"), slow_cpu) as trainer:
        assert trainer.on_device and trainer.on_device[0] == "embedding+head"  # home last, needed first
        assert trainer.placement.saving > 0
        results = trainer.run(2)
    lines = [line for line in capsys.readouterr().out.splitlines() if "optim.placement" in line]
    assert len(lines) == 1 and lines[0].startswith("optim.placement=split: optimizer placement: ")
    assert "embedding+head" in lines[0] and "predicted saving" in lines[0]
    cpu_results, _, _ = run(make_cfg("bf16", "never", CLIP))
    assert [r.loss for r in results] == [r.loss for r in cpu_results[:2]]


def test_auto_on_a_cpu_job_keeps_the_cpu_lane(capsys: pytest.CaptureFixture[str]) -> None:
    with window(make_cfg("fp32", "auto", CLIP, "auto")) as trainer:
        assert trainer.on_device == () and trainer.lane is None
    assert "optim.placement" not in capsys.readouterr().out
    with window(make_cfg("fp32", "auto", CLIP)) as trainer, pytest.raises(ValueError, match="no group named block9"):
        trainer.use_device_lane(("block9",))


def test_plan_single_prints_the_window_split(capsys: pytest.CaptureFixture[str]) -> None:
    from sysx.single.plan_cmd import main

    args = [
        "--model",
        "llama2_7b",
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--hardware",
        "h100",
        "--host-gb",
        "512",
        "--placement",
        "split",
        "--cpu-adam-mparams",
    ]
    assert main([*args, "100"]) == 0  # 2 workers x 0.1 Gparams/s: 34 s of CPU Adam a step against a 28 s step
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("optim.placement=split: optimizer placement: ") and "embedding+head" in line
    assert main([*args, "1e6"]) == 0  # a CPU a thousand times faster needs no device
    line = capsys.readouterr().out.splitlines()[-1]
    assert "all 33 groups on the CPU (6.74B parameters): the device lane would not end" in line
    assert main(args[:-3]) == 0 and "optim.placement" not in capsys.readouterr().out  # cpu: the plan alone


@pytest.mark.parametrize(("block_params", "timed"), [(47 * M, 1 << 24), (3 * M, 3 * M), (1000, 1 << 20)])
def test_the_cpu_adam_rate_is_timed_on_a_block_sized_tensor(
    monkeypatch: pytest.MonkeyPatch, block_params: int, timed: int
) -> None:
    """On 1M elements 16 OpenMP threads time mostly their own start-up: the H200 host measured 0.13 G
    params/s there against 3.9 G/s on a block, and the lane took every group of a 0.9B model, 2.6x
    slower per step. The rate is timed on a block (capped at 16M elements) and shared by the workers."""
    import sysx.machine.adam_rate as adam_rate
    from sysx.single.lanes import window_rates

    seen: list[int] = []
    monkeypatch.setattr(adam_rate, "adam_params_per_s", lambda numel, **kw: seen.append(numel) or 4e9)
    plan = SimpleNamespace(
        sizes=SimpleNamespace(block_params=block_params),
        device_budget=10,
        device_bytes={"total": 4, "activation ring": 2},
    )
    hw = assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=8)
    rates = window_rates(hw, plan, workers=2, backend="torch")  # type: ignore[arg-type]
    assert seen == [timed] and rates.cpu_params_per_s == 2e9
    assert window_rates(hw, plan, workers=2, backend="torch", cpu_params_per_s=1e8).cpu_params_per_s == 1e8  # type: ignore[arg-type]
