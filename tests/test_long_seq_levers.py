"""The long-sequence what-if study (planner only, one cell): the idle cuts plan a faster step and
stay under the busiest rank's zero-idle ceiling; a block's activations are slower to send than to
recompute; the smallest kept set (the first backward round) holds activations for as long as the
plan's timeline says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "long_seq_levers", Path(__file__).parents[1] / "profiling" / "long_seq_levers.py"
)
assert _SPEC is not None and _SPEC.loader is not None
levers = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(levers)


def test_the_idle_cuts_plan_faster_and_stay_under_the_zero_idle_ceiling() -> None:
    c = levers.cell("10b", 2048)
    r = c["ratios"]
    assert r["opt spread"] > r["s4d3"]
    assert max(r["opt spread"], r["head fused"]) < r["ceiling"]
    assert r["no recompute, last round"] > r["opt spread"]  # cutting work, not idle
    assert c["link_over_recompute"] > 1.0


def test_the_head_cut_bound_moves_the_head_without_losing_work() -> None:
    _, splan = levers.plan("10b", 2048, f"sysx:cfg3{levers.LEVER_LAYOUT}")
    t, cut = splan.table, levers._head_cut(splan.table)
    assert sum(cut.fwd) == pytest.approx(sum(t.fwd))
    assert sum(cut.bwd) == pytest.approx(sum(t.bwd))
    assert max(cut.bwd) < max(t.bwd)  # the Head's sub-stage is a plain one now
    r = levers.cell("10b", 2048)["ratios"]
    assert r["head cut"] > r["s4d3"]
    assert r["head cut + opt spread"] > max(r["head cut"], r["opt spread"])


def test_the_first_backward_round_kept_cuts_less_work_and_holds_its_activations_until_their_backward() -> None:
    c = levers.cell("10b", 2048)
    r = c["ratios"]
    assert r["s4d3"] < r["no recompute, 1st bwd round"] < r["no recompute, last round"]
    sched, splan = levers.plan("10b", 2048, f"sysx:cfg3{levers.LEVER_LAYOUT}")
    one = levers.held_bytes(sched, splan.table, 1.0, 1)  # in activations of one sub-stage and micro-batch
    # every rank backpropagates one kept sub-stage of every micro-batch; a micro-batch's activations
    # wait at least for the sub-stages before it in the ring, so more than one is held at a time
    assert len(one) == sched.n_ranks and all(1.0 < h <= sched.n_micro for h in one)
    two = levers.held_bytes(sched, splan.table, 1.0, 2)
    assert all(b > a for a, b in zip(one, two, strict=True))
    assert 0.0 < c["held_gib"] < c["free_gib"]


def test_fusing_the_head_for_some_micro_batches_saves_their_recompute_and_beats_both_ends() -> None:
    sched, splan = levers.plan("10b", 2048, f"sysx:cfg3{levers.LEVER_LAYOUT}")
    t = splan.table
    head = t.fwd[-1] - t.fwd[-2]
    half = levers._head_fused(t, 0.5)
    # half the micro-batches skip the Head's recompute: one Head forward each, the rest moves ranks
    assert sum(half.fwd) + sum(half.bwd) == pytest.approx(sum(t.fwd) + sum(t.bwd) - 0.5 * head)
    k, it = levers.best_share(sched, t, levers._head_fused)
    # rank Ng-1 carries the fill and rank 0 starts the drain: the Head on either alone is slower
    # than a split, so the best share lies strictly between none and all
    assert 0 < k < sched.n_micro
    assert it < min(levers.iteration(sched, t), levers.iteration(sched, levers._head_fused(t)))


def test_the_drain_is_the_last_micro_batch_crossing_the_last_backward_round() -> None:
    sched, splan = levers.plan("10b", 2048, f"sysx:cfg3{levers.LEVER_LAYOUT}")
    t = splan.table
    it, tail = levers.drain(sched, t)
    hop = t.bwd[t.split + 1]  # a plain one-block sub-stage's backward of one micro-batch
    # one hop a rank after the first rank's last backward, plus the transfers between them
    assert (sched.n_ranks - 1) * hop <= tail <= 1.25 * (sched.n_ranks - 1) * hop
    assert it == pytest.approx(levers.iteration(sched, t))
    r = levers.cell("10b", 2048)["ratios"]
    assert r["head cut + opt spread + drain halved"] > r["head cut + opt spread"]


def test_one_sequence_micro_batches_halve_the_drain_as_the_estimate_assumes() -> None:
    sched2, plan2 = levers.plan("10b", 2048, f"sysx:cfg3{levers.LEVER_LAYOUT}")
    sched1, plan1 = levers.plan("10b", 2048, f"sysx:cfg3{levers.LEVER_LAYOUT}", micro_batch=1)
    assert sched1.n_micro == 2 * sched2.n_micro  # the node's batch kept
    _, tail2 = levers.drain(sched2, plan2.table)
    _, tail1 = levers.drain(sched1, plan1.table)
    assert tail1 == pytest.approx(tail2 / 2, rel=0.15)


def test_a_block_per_stage_plans_faster_than_the_levers_layout_with_its_last_step_spread() -> None:
    """The default layout (one Block per stage, d = 1) against 4 stages per rank of d = 3 with the same
    spread last step: a third of the fill, the Head alone as the first backward sub-stage."""
    r = levers.cell("10b", 2048)["ratios"]
    assert r["a block per stage"] > r["opt spread"] > r["s4d3"]
    sched, _ = levers.plan("10b", 2048, "sysx:cfg3")
    assert (sched.n_stages, sched.split) == (49, 1)  # 48 Blocks: the Embedding rides with the first


def test_a_free_head_gains_a_fraction_of_its_backward_at_a_block_per_stage() -> None:
    """At the default layout the Head is a stage of its own and leads the backward ring: with its
    backward free, its rank waits for the first backward round's wave instead, so no Head lever
    (fused, cut, split over ranks) can take more than a fraction of the Head's time off the step."""
    sched, plan = levers.plan("10b", 2048, "sysx:cfg3", head_input_grad=0)
    t = plan.table
    assert list(sched.partition.layers(sched.n_stages - 1, 0)) == [plan.model.config.n_layers + 1]  # the Head alone
    saved = levers.iteration(sched, t) - levers.iteration(sched, levers._head_free(t))
    head = t.bwd[-1] * sched.n_micro  # the Head's backward over every micro-batch
    assert 0.0 < saved < head / 3
    r = levers.cell("10b", 2048)["ratios"]
    assert r["a block per stage"] < r["block, head free"]


def test_splitting_the_head_between_its_two_ranks_saves_the_recompute_of_its_share_and_beats_both_ends() -> None:
    """At the default layout the Head's forward rank ends the forward and the next rank leads the
    backward ring: a share of the Head fused on the former (no recompute) relieves the latter, and
    the best share lies strictly between none and all."""
    sched, plan = levers.plan("10b", 2048, "sysx:cfg3", head_input_grad=0)
    t = plan.table
    head = t.fwd[-1]  # the Head is a stage of its own: its forward
    half = levers._head_split(t, 0.5)
    assert sum(half.fwd) + sum(half.bwd) == pytest.approx(sum(t.fwd) + sum(t.bwd) - 0.5 * head)
    assert half.fwd[:-1] == t.fwd[:-1] and half.bwd[:-1] == t.bwd[:-1]
    k, it = levers.best_share(sched, t, levers._head_split)
    assert 0 < k < sched.n_micro
    assert it < min(levers.iteration(sched, t), levers.iteration(sched, levers._head_split(t, 1.0)))


def test_the_head_s_input_gradient_moved_by_the_schedule_plans_faster_and_the_default_moves_it() -> None:
    """``schedule.head_input_grad`` priced by the schedule the runtime runs: at 10B/4096 a share of
    the micro-batches plans faster than none and than all, and the default (3/4) moves some."""
    sched, plan = levers.plan("10b", 4096, "sysx:cfg3", head_input_grad=0)
    t = plan.table
    k, it = levers.best_moved("10b", 4096, t)
    none = levers.iteration(sched, t)
    every = levers.iteration(levers.plan("10b", 4096, "sysx:cfg3", head_input_grad=sched.n_micro)[0], t)
    assert 0 < k < sched.n_micro and it < min(none, every)
    default, _ = levers.plan("10b", 4096, "sysx:cfg3")
    assert len(default.options.head_igrad) == 6 and levers.iteration(default, t) < none
