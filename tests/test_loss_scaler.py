"""Loss scaler and LR schedule (the helpers every trainer shares)."""

from __future__ import annotations

import math

import pytest

from sysx.optim.loss_scaler import (
    DynamicLossScaler,
    FiniteCheckScaler,
    LossScaleTooSmall,
    NonFiniteGradients,
    make_scaler,
)
from sysx.optim.lr_schedule import lr_at


def test_dynamic_backoff_skips_and_counts() -> None:
    s = DynamicLossScaler(init_scale=1024.0, backoff_factor=0.5, growth_interval=3)
    assert s.update(True) is True
    assert s.scale == 512.0 and s.skipped_steps == 1
    assert s.update(False) is False
    assert s.scale == 512.0


def test_dynamic_growth_after_interval_resets_on_overflow() -> None:
    s = DynamicLossScaler(init_scale=8.0, growth_factor=2.0, growth_interval=3)
    for _ in range(2):
        s.update(False)
    s.update(True)  # resets the run of good steps
    assert s.scale == 4.0
    for _ in range(2):
        s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0
    for _ in range(3):
        s.update(False)
    assert s.scale == 16.0


def test_dynamic_min_scale_raises_clearly() -> None:
    s = DynamicLossScaler(init_scale=4.0, min_scale=2.0)
    s.update(True)
    assert s.scale == 2.0
    with pytest.raises(LossScaleTooSmall, match="min_scale=2"):
        s.update(True)


def test_dynamic_state_dict_roundtrip() -> None:
    a = DynamicLossScaler(init_scale=64.0, growth_interval=5)
    for found in (False, True, False, False):
        a.update(found)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    for found in (False, False, False, True, False):
        assert a.update(found) == b.update(found)
        assert a.scale == b.scale and a.skipped_steps == b.skipped_steps


@pytest.mark.parametrize(
    "kw", [dict(init_scale=0.0), dict(growth_factor=0.5), dict(backoff_factor=1.0), dict(growth_interval=0)]
)
def test_dynamic_rejects_bad_arguments(kw: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        DynamicLossScaler(**kw)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_finite_check_scaler(precision: str) -> None:
    s = make_scaler(precision, init_scale=2.0**16, min_scale=1.0)
    assert isinstance(s, FiniteCheckScaler) and s.scale == 1.0
    assert s.update(False) is False
    with pytest.raises(NonFiniteGradients, match=precision):
        s.update(True)
    t = make_scaler(precision)
    t.load_state_dict(s.state_dict())
    assert t.scale == 1.0


def test_make_scaler_fp16_and_errors() -> None:
    s = make_scaler("fp16", init_scale=128.0, growth_interval=7)
    assert isinstance(s, DynamicLossScaler) and s.scale == 128.0 and s.growth_interval == 7
    with pytest.raises(ValueError, match="'fp8'"):
        make_scaler("fp8")
    with pytest.raises(TypeError, match="hysteresis"):
        make_scaler("fp16", hysteresis=2)
    with pytest.raises(ValueError, match="not 'dynamic'"):
        s.load_state_dict(make_scaler("bf16").state_dict())


def test_lr_warmup_then_cosine() -> None:
    kw = dict(lr=1.0, warmup_steps=4, total_steps=14, min_lr=0.1)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == 1.0
    assert lr_at(9, **kw) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_at(14, **kw) == pytest.approx(0.1)
    assert lr_at(100, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(4, 15)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert lr_at(5, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.1)))


def test_lr_no_warmup_and_errors() -> None:
    assert lr_at(0, lr=2.0, warmup_steps=0, total_steps=10, min_lr=0.0) == 2.0
    assert lr_at(3, lr=2.0, warmup_steps=5, total_steps=5, min_lr=0.0) == pytest.approx(1.6)
    assert lr_at(7, lr=2.0, warmup_steps=5, total_steps=5, min_lr=0.0) == 2.0
    with pytest.raises(ValueError, match="step=-1"):
        lr_at(-1, lr=1.0, warmup_steps=0, total_steps=10, min_lr=0.0)
    with pytest.raises(ValueError, match="min_lr=2"):
        lr_at(0, lr=1.0, warmup_steps=0, total_steps=10, min_lr=2.0)
