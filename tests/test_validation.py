"""Post-step validation (single process): clipping by undo + re-step, overflow rollback, sync mode."""

from __future__ import annotations

import logging
import math
import threading

import pytest
import torch

from sysx.optim import OptimizerThreads, StageOptimizer, make_scaler, post_step_validate, sync_step
from sysx.optim.loss_scaler import LossScaleTooSmall, NonFiniteGradients
from sysx.optim.validation import clip_coefficient

SIZES = {"s1.1": 3001, "s1.0": 2003, "s0.1": 4007}  # backward order: later stages first


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = threading.active_count()
    yield
    assert threading.active_count() == before


def _stages(backend: str, rollback: str = "undo", *, target_dtype=torch.bfloat16) -> list[StageOptimizer]:
    out = []
    for i, (name, n) in enumerate(SIZES.items()):
        master = torch.randn(n, generator=torch.Generator().manual_seed(100 + i)) * 0.02
        target = master.to(target_dtype) if target_dtype is not None else None
        out.append(
            StageOptimizer(
                name,
                master,
                lr=1e-3,
                betas=(0.9, 0.95),
                weight_decay=0.1,
                backend=backend,
                rollback=rollback,
                target=target,
            )
        )
    return out


def _grads(it: int, scale: float = 1.0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + it)
    return {name: (torch.randn(n, generator=gen) * 0.5 * scale).to(dtype) for name, n in SIZES.items()}


def _state(stages: list[StageOptimizer]) -> list[torch.Tensor]:
    return [t.clone() for s in stages for t in (s.master, s.optimizer.exp_avg, s.optimizer.exp_avg_sq)]


def _async_iteration(threads: OptimizerThreads, grads, scaler, *, lr: float, max_grad_norm: float = 0.0):
    for name, g in grads.items():
        threads.submit_step(name, g, None, scale=scaler.scale, lr=lr)
    return post_step_validate(threads.wait(), threads, scaler, lr=lr, max_grad_norm=max_grad_norm)


def test_clip_coefficient_matches_torch() -> None:
    assert clip_coefficient(10.0, 0.0) == 1.0
    assert clip_coefficient(0.5, 1.0) == 1.0
    g = [torch.full((4,), 3.0)]
    p = [torch.nn.Parameter(torch.zeros(4))]
    p[0].grad = g[0].clone()
    torch.nn.utils.clip_grad_norm_(p, 1.0)
    assert p[0].grad[0].item() == pytest.approx(3.0 * clip_coefficient(6.0, 1.0), rel=1e-7)


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
def test_clipped_async_steps_equal_clip_grad_norm_then_adamw(backend: str) -> None:
    """Async steps + post-step clipping (undo, re-step) == clip_grad_norm_ + torch.optim.AdamW."""
    stages = _stages(backend, target_dtype=None)
    ref = [torch.nn.Parameter(s.master.clone()) for s in stages]
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    scaler = make_scaler("fp32")
    iters = 6
    with OptimizerThreads(stages, workers=2) as threads:
        for it in range(iters):
            lr = 1e-3 * (it + 1) / iters
            grads = _grads(it, scale=0.05 if it == 3 else 1.0)  # iteration 3 stays under the threshold
            out = _async_iteration(threads, grads, scaler, lr=lr, max_grad_norm=5.0)
            for p, g in zip(ref, grads.values()):
                p.grad = g.clone()
            norm = torch.nn.utils.clip_grad_norm_(ref, 5.0)
            ref_opt.param_groups[0]["lr"] = lr
            ref_opt.step()
            assert out.grad_norm == pytest.approx(float(norm), rel=1e-5)
            assert (out.clip_coef < 1.0) == (it != 3) and out.restepped == (3 if it != 3 else 0)
            assert not out.skipped
    for s, p in zip(stages, ref):
        st = ref_opt.state[p]
        torch.testing.assert_close(s.master, p.detach(), rtol=0, atol=iters * 1e-3 * 1e-4 + 1e-8)
        torch.testing.assert_close(s.optimizer.exp_avg, st["exp_avg"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(s.optimizer.exp_avg_sq, st["exp_avg_sq"], rtol=5e-5, atol=1e-10)
        assert s.optimizer.step_count == iters
        s.close()


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
def test_snapshot_async_clip_is_bit_identical_to_sync_clip(backend: str) -> None:
    a, b = _stages(backend, "snapshot"), _stages(backend, "snapshot")
    sa, sb = make_scaler("bf16"), make_scaler("bf16")
    with OptimizerThreads(a, workers=2) as ta, OptimizerThreads(b, workers=1) as tb:
        for it in range(3):
            grads = _grads(it, dtype=torch.bfloat16)
            oa = _async_iteration(ta, grads, sa, lr=1e-3, max_grad_norm=2.0)
            ob = sync_step(grads, tb, sb, lr=1e-3, max_grad_norm=2.0)
            assert oa.grad_norm == ob.grad_norm and oa.clip_coef == ob.clip_coef < 1.0
    assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))
    assert all(torch.equal(x.target, y.target) for x, y in zip(a, b))
    for s in a + b:
        assert torch.equal(s.target, s.master.bfloat16())
        s.close()


@pytest.mark.parametrize("rollback", ["undo", "snapshot"])
def test_overflow_in_one_stage_rolls_back_every_stage(rollback: str, caplog: pytest.LogCaptureFixture) -> None:
    stages = _stages("torch", rollback, target_dtype=torch.float16)
    scaler = make_scaler("fp16", init_scale=2.0**10, growth_interval=100)
    with OptimizerThreads(stages, workers=2) as threads:
        _async_iteration(threads, {k: v.half() for k, v in _grads(0, 2.0**10).items()}, scaler, lr=1e-3)
        before = _state(stages)
        targets = [s.target.clone() for s in stages]
        grads = {k: v.half() for k, v in _grads(1, 2.0**10).items()}
        grads["s1.0"][5] = float("inf")
        with caplog.at_level(logging.WARNING, logger="sysx.optim"):
            out = _async_iteration(threads, grads, scaler, lr=1e-3)
    assert (
        "step skipped: inf/nan gradients in 1 stage(s); 2 local stage(s) rolled back; loss scale 1024 -> 512"
        in caplog.text
    )
    assert out.overflow and out.skipped and out.undone == 2 and math.isinf(out.grad_norm)
    assert out.scale == 2.0**10 and out.next_scale == 2.0**9 and scaler.skipped_steps == 1
    for s in stages:
        assert s.optimizer.step_count == 1 and s.optimizer.lr == 1e-3
    after = _state(stages)
    for x, y in zip(after, before):
        if rollback == "snapshot":
            assert torch.equal(x, y)
        else:  # within the undo bound: ~1 ulp of the larger of old and new value
            torch.testing.assert_close(x, y, rtol=2.0**-22, atol=4 * 2.0**-23 * float(y.abs().max()))
    for s, t in zip(stages, targets):  # the 16-bit copy follows the restored masters
        assert torch.equal(s.target, s.master.half())
        assert float((s.target.float() - t.float()).abs().max()) <= float(t.float().abs().max()) * 2**-10
        s.close()


def test_bf16_nonfinite_raises_after_rolling_back() -> None:
    stages = _stages("torch", "snapshot")
    before = _state(stages)
    scaler = make_scaler("bf16")
    grads = _grads(0, dtype=torch.bfloat16)
    grads["s0.1"][0] = float("nan")
    with OptimizerThreads(stages) as threads, pytest.raises(NonFiniteGradients, match="bf16"):
        _async_iteration(threads, grads, scaler, lr=1e-3)
    assert all(torch.equal(x, y) for x, y in zip(_state(stages), before))


def test_sync_mode_validates_first() -> None:
    stages = _stages("torch")
    before = _state(stages)
    scaler = make_scaler("fp16", init_scale=4.0, min_scale=2.0)
    grads = {k: v.half() for k, v in _grads(0, 4.0).items()}
    grads["s1.1"][0] = float("-inf")
    out = sync_step(grads, stages, scaler, lr=1e-3)
    assert out.overflow and out.skipped and out.undone == 0 and scaler.scale == 2.0
    assert all(torch.equal(x, y) for x, y in zip(_state(stages), before))  # nothing stepped
    assert all(s.optimizer.step_count == 0 for s in stages)
    with pytest.raises(LossScaleTooSmall, match="min_scale=2"):
        sync_step(grads, stages, scaler, lr=1e-3)
    good = {k: v.half() for k, v in _grads(1, 2.0).items()}
    out = sync_step(good, stages, scaler, lr=1e-3)
    assert not out.skipped and all(s.optimizer.step_count == 1 for s in stages)
