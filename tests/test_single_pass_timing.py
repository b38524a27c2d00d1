"""The window's step priced from its measured passes (:mod:`sysx.single.pass_timing`) and the Head's
term in the planner's step (issue 27, point 3)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sysx.model import get_preset
from sysx.single.hardware import assumed_hardware
from sysx.single.op_profile import device_profiler
from sysx.single.pass_timing import PassTimes, calibrated_table, measure_passes, timed_plan
from sysx.single.plan_costs import head_seconds
from sysx.single.plan_request import PlanRequest
from sysx.single.planner import make_plan

HW = assumed_hardware("rtx4090", host_memory_gib=64)
TINY = get_preset("tiny")
SMALL = dataclasses.replace(TINY, n_layers=2, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64)


def _plan(**kw):
    args = dict(model=TINY, seq_len=64, global_batch=8)
    args.update(kw)
    return make_plan(PlanRequest(**args), HW)


def test_the_planners_step_holds_the_head_once_per_chunk() -> None:
    plan = _plan()
    chunks = plan.chunks * plan.rounds
    head = head_seconds(plan.chunk * 64, TINY, HW)
    assert head > 0 and plan.table.head_s == pytest.approx(head)
    assert plan.times["head_s"] == pytest.approx(chunks * head)
    without = timed_plan(plan, PassTimes(plan.table.forward_s, 2 * plan.table.forward_s, 0.0))
    assert plan.times["step_s"] - without.times["step_s"] == pytest.approx(chunks * head)


def test_measured_passes_price_every_block_and_the_head() -> None:
    plan = _plan()  # every block fits: nothing slides, one unit per block per round
    assert plan.window == TINY.n_layers and plan.units == 1
    passes = PassTimes(forward_s=0.010, backward_s=0.025, head_s=0.004)
    timed = timed_plan(plan, passes)
    L, rounds = TINY.n_layers, plan.rounds
    # a round: every block's forward and backward, the Head, the last block's gradients leaving
    passes_s = L * (passes.forward_s + passes.backward_s) + passes.head_s + timed.times["t_grad_s"]
    expected = rounds * passes_s + timed.times["host_ops_s"]
    assert timed.times["step_s"] == pytest.approx(expected, rel=1e-6)
    assert timed.times["block_fwd_round_s"] == pytest.approx(passes.forward_s)
    # the choices stay the FLOPs model's: only the prices change
    assert (timed.window, timed.levels, timed.chunk, timed.rounds) == (
        plan.window,
        plan.levels,
        plan.chunk,
        plan.rounds,
    )


def test_calibration_keeps_the_levels_proportions_and_solves_the_backward() -> None:
    table = _plan().table
    passes = PassTimes(forward_s=3 * table.forward_s, backward_s=5 * table.forward_s, head_s=1e-3)
    top = len(table.saved_s) - 1
    cal = calibrated_table(table, passes, top)
    assert cal.forward_s == pytest.approx(passes.forward_s)
    assert cal.saved_s == pytest.approx([3 * s for s in table.saved_s])
    # the predictor's backward at the measured level is the measured backward
    at_top = cal.backward_ratio * cal.forward_s + cal.forward_s - cal.saved_s[top] + cal.backward_extra_s
    assert at_top == pytest.approx(passes.backward_s)
    assert cal.head_s == pytest.approx(1e-3)


def test_passes_are_timed_on_the_device_and_not_with_sequence_chunks() -> None:
    hw = assumed_hardware("rtx4090", host_memory_gib=8)
    profiler = device_profiler(SMALL, 16, torch.float32, torch.device("cpu"), measure=False)
    plan = make_plan(PlanRequest(model=SMALL, seq_len=16, global_batch=2), hw, profiler=profiler)
    passes = measure_passes(plan, torch.device("cpu"), rounds=1)
    assert passes is not None
    assert passes.forward_s > 0 and passes.backward_s > 0 and passes.head_s > 0
    # a window that keeps its graphs times the forward that keeps one and the backward through it
    counting = device_profiler(SMALL, 16, torch.float32, torch.device("cpu"), measure=False, count_graph=True)
    kept = make_plan(PlanRequest(model=SMALL, seq_len=16, global_batch=2, keep_graph=True), hw, profiler=counting)
    assert kept.keep_graph
    kept_passes = measure_passes(kept, torch.device("cpu"), rounds=1)
    # the backward is both passes' mean less the forward's, two windows apart: on a busy machine one
    # stalled forward window can exceed it (clamped to 0); the subtraction itself is checked with
    # fixed times in test_the_passes_are_timed_together_in_rounds_over_a_tenth_of_a_second
    assert kept_passes is not None and kept_passes.forward_s > 0 and kept_passes.backward_s >= 0
    chunked = make_plan(PlanRequest(model=SMALL, seq_len=16, global_batch=2, seq_chunk=8), hw)
    assert chunked.seq_chunk == 8
    assert measure_passes(chunked, torch.device("cpu"), rounds=1) is None
    assert timed_plan(chunked, None) is chunked


def test_the_heap_planning_freed_is_handed_back_before_the_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    """``schedule=single`` trims the heap before its memory baseline, as every pipeline rank does: the
    planner's profiled passes freed pages the state would reuse unseen (tiny read 12-19% short).
    That the trim frees pages: tests/test_host_costs.py."""
    from sysx.trainers import prediction

    order: list[str] = []
    monkeypatch.setattr(prediction, "release_free_heap", lambda: order.append("trim") or True)
    monkeypatch.setattr(prediction, "start_host_peak", lambda backend: order.append(f"baseline {backend}") or 0)
    prediction.SinglePrediction(None, torch.device("cpu"), "auto")
    assert order == ["trim", "baseline auto"]  # after the job's optimizer op (tests/test_host_costs.py)


def test_the_passes_are_timed_together_in_rounds_over_a_tenth_of_a_second(monkeypatch) -> None:
    """The three passes are timed as the pipeline's profile times its layers: each the mean of
    ROUNDS rounds over all three, their windows SPAN_S together (a tiny pass's five runs fit in one
    burst of another process's work); the kept-graph backward is both passes less the forward."""
    from sysx.single import pass_timing

    asked: list[tuple[int, int, float]] = []

    def fake(steps, *, rounds, window_s):
        asked.append((len(steps), rounds, window_s))
        return [1.0, 3.0, 0.5]

    monkeypatch.setattr(pass_timing, "mean_in_rounds", fake)
    hw = assumed_hardware("rtx4090", host_memory_gib=8)
    profiler = device_profiler(SMALL, 16, torch.float32, torch.device("cpu"), measure=False)
    plan = make_plan(PlanRequest(model=SMALL, seq_len=16, global_batch=2), hw, profiler=profiler)
    assert measure_passes(plan, torch.device("cpu")) == PassTimes(1.0, 3.0, 0.5)
    counting = device_profiler(SMALL, 16, torch.float32, torch.device("cpu"), measure=False, count_graph=True)
    kept = make_plan(PlanRequest(model=SMALL, seq_len=16, global_batch=2, keep_graph=True), hw, profiler=counting)
    assert measure_passes(kept, torch.device("cpu")) == PassTimes(1.0, 2.0, 0.5)
    assert asked == [(3, pass_timing.ROUNDS, pytest.approx(pass_timing.SPAN_S / pass_timing.ROUNDS))] * 2
