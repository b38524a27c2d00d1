"""SysX's default layout: one Block per forward stage, d = 1 (:func:`sysx.runtime.options.block_stages`),
the backward ring going on from the last forward stage's rank; the fallbacks, a manual cut of the
same shape, and the tuner searching it (its stages per rank are no whole number: the keys stay null)."""

from __future__ import annotations

import dataclasses

import pytest

from sysx.autotune.apply import apply_choice, choice
from sysx.autotune.search import Job, Space, search
from sysx.config import SysxConfig
from sysx.model import get_preset
from sysx.runtime.options import (
    PipelineOptions,
    block_layout,
    block_stages,
    make_schedule,
    options_from_config,
)
from tests.test_autotune import ROOMY, SEQ, TINY, synthetic_profile

LLAMA = get_preset("llama2_7b")  # 32 Blocks: 34 flat layers, at least 12 a rank on 2 ranks
DEEPER = dataclasses.replace(TINY, n_layers=22)  # 24 flat layers


def test_the_default_layout_is_a_block_per_stage_with_the_head_alone_and_one_rank_at_both_ends() -> None:
    sched = make_schedule(PipelineOptions(), LLAMA, n_ranks=2, n_micro=8, seq_len=64)
    p = sched.partition
    assert (sched.n_stages, sched.split) == (block_stages(34), 1) == (33, 1)
    assert list(p.stage_layers(0)) == [0, 1]  # the Embedding rides with the first Block
    assert list(p.stage_layers(32)) == [33]  # the Head alone
    assert all(len(p.stage_layers(s)) == 1 for s in range(1, 33))
    a = sched.assignment
    first, last = a.bwd_order[0], a.bwd_order[-1]
    assert first == (32, 0) and last == (0, 0)
    # the backward goes on around the forward's ring: the Head's backward on the rank after the
    # Head's forward, and the last sub-stage (no drain after it) on that same rank
    assert a.bwd_rank[32][0] == a.bwd_rank[0][0] == (a.fwd_rank[32] + 1) % 2 == 1
    assert block_layout(PipelineOptions(), sched, LLAMA)


@pytest.mark.parametrize(
    "opts,layout",
    [
        (PipelineOptions(stages_per_rank=4), (8, 3)),  # a layout key given: the old rule
        (PipelineOptions(split=2), (4, 2)),
        (PipelineOptions(cfg=1), (4, 2)),  # synchronous checkpoints: the paper's d = 2
        (PipelineOptions(schedule="mobius"), (4, 1)),
    ],
)
def test_layout_keys_and_other_schedules_keep_their_rules(opts: PipelineOptions, layout: tuple[int, int]) -> None:
    sched = make_schedule(opts, LLAMA, n_ranks=2, n_micro=8, seq_len=64)
    assert (sched.n_stages, sched.split) == layout
    assert not block_layout(opts, sched, LLAMA)


def test_a_model_with_few_layers_a_rank_keeps_the_old_rule() -> None:
    """Below 12 flat layers a rank (where 4 stages per rank of d = 3 applied before) the block layout's
    extra forward stages cost more host work than they save: 2 stages per rank, as before."""
    sched = make_schedule(PipelineOptions(), TINY, n_ranks=2, n_micro=4, seq_len=16)  # 6 flat layers
    assert (sched.n_stages, sched.split) == (2, 2)
    assert make_schedule(PipelineOptions(), DEEPER, n_ranks=2, n_micro=4, seq_len=16).n_stages == 23  # 12 a rank
    assert make_schedule(PipelineOptions(), DEEPER, n_ranks=3, n_micro=4, seq_len=16).n_stages != 23


def test_a_manual_cut_of_a_stage_count_no_multiple_of_the_ranks_runs_as_given() -> None:
    sizes = [
        len(make_schedule(PipelineOptions(), LLAMA, n_ranks=2, n_micro=8, seq_len=64).partition.stage_layers(s))
        for s in range(33)
    ]
    sched = make_schedule(PipelineOptions(stage_sizes=sizes), LLAMA, n_ranks=2, n_micro=8, seq_len=64)
    assert (sched.n_stages, sched.split) == (33, 1)  # d = 3 and 2 need 3 and 2 layers a stage: d = 1


def test_the_tuner_searches_the_block_layout_and_its_choice_builds_it_again() -> None:
    job = Job(DEEPER, SEQ, 8, 2, work_dtype="float32", optim_backend="torch")
    space = Space(
        stages_per_rank=(1,), splits=(1,), cfgs=(3,), param_buffers=(2,), micro_batch_sizes=(2,), optimizer_workers=(1,)
    )
    res = search(job, ROOMY, synthetic_profile(), space)
    layouts = {(c.options.stages_per_rank, c.options.split) for c in res.fitting}
    assert layouts == {(None, None), (1, 1)}
    block = next(c for c in res.fitting if c.options.stages_per_rank is None)
    assert "stages_per_rank=null split=null" in block.label()
    keys = choice(block)
    cfg = apply_choice(SysxConfig(schedule=dataclasses.replace(SysxConfig().schedule, name="sysx")), keys)
    again = make_schedule(options_from_config(cfg), DEEPER, n_ranks=2, n_micro=4, seq_len=SEQ)
    assert (again.n_stages, again.split) == (block_stages(DEEPER.n_layers + 2), 1) == (23, 1)
    without = search(job, ROOMY, synthetic_profile(), dataclasses.replace(space, block_stages=False))
    assert {(c.options.stages_per_rank, c.options.split) for c in without.fitting} == {(1, 1)}
