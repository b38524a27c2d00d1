"""Optimizer placement (Deep Optimizer States): the performance model as a pure function, and the
device lane's numerics against the CPU lane's."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from sysx.optim.cpu_adam import CpuAdam
from sysx.optim.device_lane import DeviceLane
from sysx.optim.placement import (
    LaneRates,
    Placement,
    Unit,
    choose,
    count,
    device_seconds,
    finish_times,
    place,
    record,
    seconds,
    summarize,
)
from sysx.optim.stage import StageOptimizer

GB = 1e9
# a V100 node's figures: 12 GB/s each way, 800 GB/s device memory, 0.1 Gparams/s per CPU thread
RATES = LaneRates(
    cpu_params_per_s=0.1e9,
    cpu_workers=2,
    h2d_bytes_per_s=12 * GB,
    d2h_bytes_per_s=12 * GB,
    device_mem_bytes_per_s=800 * GB,
)
M = 1_000_000


def test_lanes_cost_what_their_rates_say() -> None:
    t_in, t_step, t_out = device_seconds(100 * M, RATES)
    assert (t_in, t_step, t_out) == pytest.approx((1600e6 / 12e9, 2800e6 / 800e9, 1200e6 / 12e9))
    units = [Unit("a", 100 * M, 0.0), Unit("b", 100 * M, 0.0), Unit("c", 100 * M, 0.5)]
    ends = finish_times(units, (), RATES, device_idle=1.0)
    assert ends == pytest.approx({"a": 1.0, "b": 1.0, "c": 2.0})  # two workers; c waits for one
    ends = finish_times(units, ("c",), RATES, device_idle=1.2)
    # speculating: the decision waits for the CPU lane (1.0) and the device for its passes (1.2)
    assert ends["c"] == pytest.approx(1.2 + t_in + t_step + t_out)
    ends = finish_times(units, ("c",), RATES, device_idle=0.0, speculative=False)
    assert ends["a"] == pytest.approx(0.5 + 1.0)  # validate first: the CPU lane starts at the decision


def test_the_units_ready_last_go_to_the_device_when_it_is_faster() -> None:
    # four sub-stages; the last two are ready when the backward ends (1.0 s), the device is idle then
    units = [
        Unit("s1.1", 100 * M, 0.0),
        Unit("s1.0", 100 * M, 0.3),
        Unit("s0.1", 100 * M, 0.9),
        Unit("s0.0", 100 * M, 1.0),
    ]
    p = place(units, RATES, device_idle=1.0)
    assert p.cpu_finish == pytest.approx(2.3)  # s0.1 on a worker from 1.0 (s1.1 ends), s0.0 from 1.3
    assert "s0.0" in p.device and "s1.1" not in p.device
    assert p.saving > 0.5 and p.finish == pytest.approx(max(p.ends.values()))
    assert "predicted saving" in p.describe(units) and "s0.0" in p.describe(units)


def test_the_split_is_printed_in_seconds_and_readable_parameter_counts() -> None:
    assert (count(2.16e9), count(12.6e6), count(850e3), count(96)) == ("2.16B", "12.6M", "850K", "96")
    assert (seconds(21.5), seconds(0.0032), seconds(0.0)) == ("21.50 s", "3.2 ms", "0.00 s")
    units = [Unit("s1.0", 1_200_000_000, 0.0), Unit("s0.0", 960_000_000, 1.0)]
    split = Placement(("s0.0",), cpu_finish=21.5, finish=20.25)
    assert split.describe(units, "sub-stage") == (
        "optimizer placement: 1 of 2 sub-stages on the device (s0.0; 960M of 2.16B parameters): optimizer work "
        "ends 20.25 s into the step instead of 21.50 s, predicted saving 1.25 s per step"
    )
    none = Placement((), cpu_finish=21.5, finish=21.5)
    assert none.describe(units, "sub-stage") == (
        "optimizer placement: all 2 sub-stages on the CPU (2.16B parameters): the device lane would not end the "
        "optimizer work earlier (optimizer work ends 21.50 s into the step)"
    )
    full = dataclasses.replace(none, why="no unit's states fit in the device memory left free")
    assert "CPU (2.16B parameters): no unit's states fit" in full.describe(units)
    small = dataclasses.replace(RATES, device_free_bytes=1.0)  # the model says so when it is the reason
    assert place(units, small, device_idle=1.0).why == full.why


def test_one_line_sums_up_every_ranks_split() -> None:
    units = [Unit("a", 100 * M, 0.0), Unit("b", 100 * M, 1.0)]
    r0, r1 = Placement(("b",), 2.3, 1.2), Placement(("a", "b"), 2.4, 1.05)
    line = summarize([(r0, units), (r1, units)], "sub-stage")
    assert line == (
        "optimizer placement over 2 ranks: 3 of 4 sub-stages on the device (per rank 1/2, 2/2; 300M "
        "of 400M parameters): optimizer work ends 1.05-1.20 s into the step instead of 2.30-2.40 s, "
        "predicted saving 1.10-1.35 s per step"
    )
    assert "(2/2 on each rank;" in summarize([(r1, units), (r1, units)], "sub-stage")
    none = Placement((), 2.3, 2.3)
    assert summarize([(none, units)] * 4, "sub-stage") == (
        "optimizer placement over 4 ranks: all 8 sub-stages on the CPU (800M parameters): the device lane would not "
        "end the optimizer work earlier on any rank (optimizer work ends 2.30 s into the step)"
    )
    assert summarize([(r0, units)]) == r0.describe(units)  # one rank: its own line
    assert record(r0, units) == {
        "device": ["b"],
        "units": 2,
        "device_params": 100 * M,
        "params": 200 * M,
        "cpu_finish_s": 2.3,
        "finish_s": 1.2,
        "saving_s": pytest.approx(1.1),
    }


def test_a_slow_link_keeps_everything_on_the_cpu() -> None:
    slow = LaneRates(
        cpu_params_per_s=1e9,
        cpu_workers=4,
        h2d_bytes_per_s=0.5 * GB,
        d2h_bytes_per_s=0.5 * GB,
        device_mem_bytes_per_s=800 * GB,
    )
    units = [Unit(f"u{i}", 10 * M, 0.1 * i) for i in range(4)]
    p = place(units, slow, device_idle=0.3)
    assert p.device == () and p.saving == 0.0 and p.finish == p.cpu_finish


def test_a_busy_device_delays_its_lane() -> None:
    units = [Unit(f"u{i}", 100 * M, 0.0) for i in range(4)]  # two per worker: the CPU lane ends at 2.0
    idle_now = place(units, RATES, device_idle=0.0)
    idle_late = place(units, RATES, device_idle=5.0)
    assert idle_now.device and idle_late.device == ()


def test_choose_modes() -> None:
    units = [Unit("a", 100 * M, 0.0), Unit("b", 100 * M, 1.0)]
    split = choose("split", units, RATES, device_idle=1.0)
    assert split.device and split == place(units, RATES, device_idle=1.0)
    assert choose("auto", units, RATES, device_idle=1.0) == split
    cpu = choose("cpu", units, RATES, device_idle=1.0)
    assert cpu.device == () and cpu.finish == split.cpu_finish
    assert choose("auto", units, RATES, device_idle=1.0, separate_device=False).device == ()
    with pytest.raises(ValueError, match="optim.placement='gpu'"):
        choose("gpu", units, RATES, device_idle=1.0)
    with pytest.raises(ValueError, match="cpu_workers=0"):
        LaneRates(1.0, 0, 1.0, 1.0, 1.0)
    assert place([], RATES, device_idle=0.0) == Placement((), 0.0, 0.0, {})


# ------------------------------------------------------------------------------- device lane
def _states(n: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    grads = [
        torch.randn(n, generator=gen) * 10 ** float(torch.empty(1).uniform_(-3, 1, generator=gen)) for _ in range(5)
    ]
    return p, grads


@pytest.mark.parametrize("n", [1000, (1 << 18) + 4099])  # below one chunk, and across a chunk boundary
def test_device_lane_steps_bit_identically_to_the_cpu_lane_on_cpu(n: int) -> None:
    p, grads = _states(n, n)
    host = CpuAdam(p.clone(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, backend="torch")
    lane_opt = CpuAdam(p.clone(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, backend="torch")
    lane = DeviceLane("cpu")
    for i, g in enumerate(grads):
        lr = 1e-3 * (i + 1) / len(grads)
        host.step(g, lr=lr)
        if i == 2:  # a host step in between: the two lanes share one step counter and beta powers
            lane_opt.step(g, lr=lr)
        else:
            lane.step(lane_opt, g, lr=lr)
    for a, b in (
        (host.param, lane_opt.param),
        (host.exp_avg, lane_opt.exp_avg),
        (host.exp_avg_sq, lane_opt.exp_avg_sq),
    ):
        assert torch.equal(a, b)
    assert lane_opt.step_count == host.step_count == len(grads)
    with pytest.raises(RuntimeError, match="no step to undo"):
        lane_opt.undo(grads[-1])  # a device-lane step is validated first: never undone


def test_a_stage_on_the_device_lane_writes_its_target_like_a_host_step() -> None:
    n = 5000
    p, grads = _states(n, 7)
    a = StageOptimizer(
        "a", p.clone(), lr=1e-3, weight_decay=0.1, backend="torch", target=torch.empty(n, dtype=torch.bfloat16)
    )
    b = StageOptimizer(
        "b", p.clone(), lr=1e-3, weight_decay=0.1, backend="torch", target=torch.empty(n, dtype=torch.bfloat16)
    )
    lane = DeviceLane("cpu")
    for g in grads[:3]:
        for s in (a, b):
            s.new_iteration()
            s.load_grads(g.to(torch.bfloat16), scale=4.0)
            s.scale_grads(0.5)  # a clip coefficient
        a.apply(2e-3)
        b.apply_on(lane, 2e-3)
    assert torch.equal(a.master, b.master) and torch.equal(a.target, b.target) and not b.stepped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_lane_on_a_gpu_is_within_an_ulp_of_the_cpu_lane() -> None:
    n = 1 << 20
    p, grads = _states(n, 3)
    host = CpuAdam(p.clone(), lr=1e-3, weight_decay=0.1, backend="torch")
    lane_opt = CpuAdam(p.clone(), lr=1e-3, weight_decay=0.1, backend="torch")
    lane = DeviceLane("cuda")
    for g in grads:
        host.step(g)
        lane.step(lane_opt, g, lr=1e-3)
    ulp = torch.finfo(torch.float32).eps
    assert float(((host.param - lane_opt.param).abs() / host.param.abs().clamp_min(1e-30)).max()) <= 8 * ulp


# ----------------------------------------------------------------------------- in the pipeline
def _pipeline_state(speculate: str, device_units: int, steps: int = 4) -> tuple[list, dict[str, torch.Tensor], list]:
    from sysx.config import EvalSection, ModelSection, OptimSection, SysxConfig, TrainSection, validate
    from sysx.runtime import PipelineOptions
    from sysx.trainers.pipeline import PipelineTrainer

    cfg = SysxConfig(
        model=ModelSection(preset="tiny"),
        train=TrainSection(steps=steps, micro_batch_size=2, micro_batches=2, seq_len=16),
        optim=OptimSection(warmup_steps=2, grad_clip=4.5, speculate=speculate, placement="cpu"),
        eval=EvalSection(every=0, batches=2),
        device="cpu",
    )
    validate(cfg)
    with PipelineTrainer(cfg, PipelineOptions(schedule="sysx", split=2, optim_backend="torch")) as trainer:
        opt = trainer.optimizer
        assert opt is not None
        placed = sorted(opt.stages)[:device_units]
        if placed:
            opt.use_device_lane({u: (0.0, 0.0, 0.0) for u in placed}, DeviceLane("cpu"), trainer.pacer)
        results = trainer.run(steps)
        return results, trainer.state_dict(), placed


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("speculate", ["never", "always"])
def test_pipeline_units_on_the_device_lane_end_bit_identical_to_the_cpu_lane(speculate: str) -> None:
    cpu_results, cpu_state, _ = _pipeline_state("never", 0)
    results, state, placed = _pipeline_state(speculate, 2)
    assert len(placed) == 2
    assert any(r.grad_norm > 4.5 for r in results) and any(r.grad_norm <= 4.5 for r in results)
    if speculate == "never":  # both validate first: every number the same, to the bit
        assert all(torch.equal(state[k], v) for k, v in cpu_state.items())
        assert [r.loss for r in results] == [r.loss for r in cpu_results]
    else:  # the CPU lane's clipped steps are undone and redone (exact to an ulp): the device lane's are not
        rel = max(float((state[k] - v).abs().max() / v.abs().max()) for k, v in cpu_state.items())
        assert rel <= 1e-5, rel
        assert all(r.restepped == 2 for r in results if r.grad_norm > 4.5)  # only the CPU lane's 2 units re-step


def test_a_unit_whose_states_do_not_fit_on_the_device_stays_on_the_cpu() -> None:
    units = [Unit(f"u{i}", 100 * M, 0.0) for i in range(4)]
    roomy = place(units, RATES, device_idle=0.0)
    tight = place(units, dataclasses.replace(RATES, device_free_bytes=20 * 100 * M - 1), device_idle=0.0)
    assert roomy.device and tight.device == ()


def test_an_emulated_device_lane_is_the_host_step_whatever_the_backend() -> None:
    p, grads = _states(3000, 11)
    host = CpuAdam(p.clone(), lr=1e-3, weight_decay=0.1, backend="auto")
    lane_opt = CpuAdam(p.clone(), lr=1e-3, weight_decay=0.1, backend="auto")
    for g in grads:
        host.step(g, lr=2e-3)
        DeviceLane(None).step(lane_opt, g, lr=2e-3)
    assert torch.equal(host.param, lane_opt.param) and torch.equal(host.exp_avg_sq, lane_opt.exp_avg_sq)


# ----------------------------------------------------------------------------- emulated device
def _pacer(time_scale: float = 1e-6):
    from sysx.config import EmulateSection, EvalSection, ModelSection, SysxConfig, TrainSection, validate
    from sysx.emulate import EmulatedPacer, emulated_model, plan_emulation
    from sysx.runtime import PipelineOptions
    from sysx.runtime.options import make_schedule

    cfg = SysxConfig(
        model=ModelSection(preset="tiny"),
        device="emulated",
        eval=EvalSection(every=0),
        train=TrainSection(steps=3, micro_batch_size=1, micro_batches=2, seq_len=16),
        emulate=EmulateSection(model="llama2_7b", seq_len=2048, micro_batch_size=2, time_scale=time_scale),
    )
    validate(cfg)
    model = emulated_model(cfg)
    schedule = make_schedule(
        PipelineOptions(schedule="sysx", optim_backend="torch"),
        model.config,
        n_ranks=2,
        n_micro=2,
        seq_len=model.seq_len,
    )
    return EmulatedPacer(plan_emulation(cfg, schedule, backend="torch"), schedule, 0, time_scale=time_scale)


def test_the_emulated_device_lane_flows_through_copy_in_step_and_copy_out() -> None:
    pacer = _pacer(1e-3)  # a modelled second is a wall millisecond: long against the calls between
    pacer.device_optimizer("s1.0", (3.0, 1.0, 2.0))
    pacer.device_optimizer("s1.1", (3.0, 1.0, 2.0))
    pacer.device_optimizer_wait()
    spans = [(lane, (end - start) / pacer.time_scale, start, end) for lane, name, start, end in pacer._stats.spans]
    h2d, gpu, d2h = ([s for s in spans if s[0] == lane] for lane in ("h2d", "gpu", "d2h"))
    assert [s[1] for s in h2d + gpu + d2h] == pytest.approx([3.0, 3.0, 1.0, 1.0, 2.0, 2.0], rel=1e-6)
    for a, b, c in zip(h2d, gpu, d2h):  # each unit: in, then step, then out
        assert a[3] <= b[2] and b[3] <= c[2]
    assert h2d[1][2] == h2d[0][3] < d2h[0][3]  # the second copy in runs while the first unit steps and copies out
    assert d2h[0][2] == gpu[0][3] < h2d[1][3]  # the first copy out starts when its step ends, not after the last


def test_an_emulated_undo_and_restep_take_the_measured_undo_cost() -> None:
    from sysx.emulate.costs import UNDO_STEPS

    pacer = _pacer()
    name = next(iter(pacer._opt))
    for kind in ("step", "undo", "restep"):
        with pacer._optimizer_span(name, None, kind):
            time.sleep(0)  # no real work: the span's modelled time alone is what is checked
    took = [(end - start) / pacer.time_scale / pacer._opt[name] for _, _, start, end in pacer._stats.spans]
    assert took == pytest.approx([1.0, UNDO_STEPS["undo"], UNDO_STEPS["undo"] + 1.0], rel=1e-4)
