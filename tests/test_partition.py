"""Partition of layers into forward stages / backward sub-stages and their assignment on ranks."""

from __future__ import annotations

import itertools

import pytest

from sysx.partition import (
    Partition,
    PartitionError,
    coupled_assignment,
    partition_layers,
    partition_model,
    sysx_assignment,
    sysx_bwd_rank,
    uniform_partition,
    unit_label,
)


def _brute_best(costs: list[float], parts: int) -> float:
    """Smallest possible largest stage cost over all contiguous cuts (exhaustive)."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize(
    "costs,parts",
    [
        ([0.0, 5, 5, 5, 5, 5, 5, 9], 3),  # embedding free, head heavy
        ([1, 8, 1, 1, 1, 1, 1, 1, 8], 4),
        ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 5),
        ([2.0] * 9, 3),
    ],
)
def test_balanced_partition_minimises_the_largest_stage(costs: list[float], parts: int) -> None:
    p = partition_layers(costs, parts)
    assert p.n_stages == parts and p.n_layers == len(costs)
    got = max(p.stage_cost(s) for s in range(parts))
    assert got == pytest.approx(_brute_best(costs, parts))
    # contiguous, non-empty, covering every layer once
    assert [i for s in range(parts) for i in p.stage_layers(s)] == list(range(len(costs)))


def test_equal_costs_give_equal_stages_and_sub_stages() -> None:
    p = partition_layers([1.0] * 12, 3, split=2)
    assert [len(p.stage_layers(s)) for s in range(3)] == [4, 4, 4]
    assert [len(p.sub_layers(s, k)) for s in range(3) for k in range(2)] == [2] * 6
    assert p.sub_layers(1, 0).start == p.stage_layers(1).start and p.sub_layers(1, 1).stop == p.stage_layers(1).stop


def test_sub_stages_balance_by_cost_inside_a_stage() -> None:
    # stage 0 = layers 0..3 with a heavy last layer: the split puts it alone
    p = partition_layers([1, 1, 1, 3, 3, 3], 2, split=2)
    assert list(p.stage_layers(0)) == [0, 1, 2, 3]
    assert [list(p.sub_layers(0, k)) for k in range(2)] == [[0, 1, 2], [3]]
    assert p.sub_cost(0, 0) == 3 and p.sub_cost(0, 1) == 3


def test_sub_cuts_balance_the_backward_work_per_rank() -> None:
    """3-layer stages split 2+1 everywhere would give SysX's odd ranks all the heavy halves."""
    costs = [1.0] * 24
    blind = partition_layers(costs, 8, split=2)
    aware = partition_layers(costs, 8, split=2, n_ranks=4)
    assert blind.stage_bounds == aware.stage_bounds

    def loads(p: Partition) -> list[float]:
        pl = sysx_assignment(8, 2, 4)
        out = [0.0] * 4
        for s in range(8):
            for k in range(2):
                out[pl.bwd_rank[s][k]] += p.sub_cost(s, k)
        return out

    assert max(loads(blind)) == 8 and min(loads(blind)) == 4
    assert loads(aware) == [6.0] * 4


def test_manual_stage_and_sub_sizes() -> None:
    p = partition_layers([1.0] * 10, 3, split=2, stage_sizes=[2, 5, 3], sub_sizes=[[1, 1], [4, 1], [1, 2]])
    assert p.stage_bounds == (0, 2, 7, 10)
    assert p.sub_bounds == ((0, 1, 2), (2, 6, 7), (7, 8, 10))
    assert p.layers(1) == range(2, 7) and p.layers(1, 0) == range(2, 6)


def test_with_split_keeps_the_forward_stages() -> None:
    p = partition_layers([1, 2, 3, 4, 5, 6, 7, 8], 2)
    q = p.with_split(3)
    assert q.stage_bounds == p.stage_bounds and q.split == 3


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(layer_costs=[1.0] * 4, n_stages=5), "5 forward stages need at least 5 layers but the model has 4"),
        (dict(layer_costs=[1.0] * 4, n_stages=2, split=3), "split d=3 needs at least 3 layers per stage"),
        (dict(layer_costs=[1.0] * 4, n_stages=2, stage_sizes=[1, 2]), "must be positive and sum to 4"),
        (dict(layer_costs=[1.0] * 4, n_stages=2, stage_sizes=[4]), "stage_sizes has 1 entries but n_stages=2"),
        (dict(layer_costs=[1.0, -1.0], n_stages=1), "must be finite and >= 0"),
        (dict(layer_costs=[], n_stages=1), "no layers"),
        (dict(layer_costs=[1.0] * 4, n_stages=0), "must be a positive int"),
        (dict(layer_costs=[1.0] * 4, n_stages=2, split=2, sub_sizes=[[2, 0], [1, 1]]), "sub_sizes[0]"),
    ],
)
def test_impossible_partitions_are_clear_errors(kwargs: dict, needle: str) -> None:
    with pytest.raises(PartitionError) as err:
        partition_layers(**kwargs)
    assert needle in str(err.value)


def test_sysx_placement_matches_figure_8() -> None:
    pl = sysx_assignment(8, 2, 4)
    assert pl.fwd_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    # q = 0..15 -> (7,1) (7,0) (6,1) (6,0) ... on ranks 0 1 2 3 0 1 ...
    assert pl.bwd_order[:4] == ((7, 1), (7, 0), (6, 1), (6, 0))
    assert pl.bwd_substages(0) == [(7, 1), (5, 1), (3, 1), (1, 1)]  # Fig. 8 caption, GPU0
    assert pl.bwd_substages(1) == [(7, 0), (5, 0), (3, 0), (1, 0)]
    assert pl.fwd_stages(0) == [0, 4]
    assert not pl.coupled
    for q, (s, k) in enumerate(pl.bwd_order):
        assert (s, k) == (7 - q // 2, 1 - q % 2) and pl.bwd_rank[s][k] == q % 4


def test_coupled_placement_and_rank_errors() -> None:
    pl = coupled_assignment(6, 3)
    assert pl.coupled and pl.fwd_stages(1) == [1, 4] and pl.bwd_substages(1) == [(4, 0), (1, 0)]
    with pytest.raises(PartitionError, match="use at least 4 stages"):
        sysx_assignment(3, 1, 4)
    with pytest.raises(PartitionError, match="Ng=0"):
        coupled_assignment(3, 0)


def test_partition_model_uses_the_model_flops() -> None:
    from sysx.model import get_preset, layer_flops

    cfg = get_preset("llama2_10b")
    p = partition_model(cfg, 2048, 8, split=2)
    assert p.n_layers == cfg.n_layers + 2
    flops = layer_flops(cfg, 2048)
    assert p.stage_cost(7) == pytest.approx(sum(flops[i] for i in p.stage_layers(7)))
    # the head is heavier than a block: the last stage has fewer blocks than the biggest others
    sizes = [len(p.stage_layers(s)) for s in range(8)]
    assert sum(sizes) == 50 and max(p.stage_cost(s) for s in range(8)) <= 1.15 * sum(flops) / 8
    assert "stage" in p.describe() and "0.0:" in p.describe()


def test_uniform_partition_and_invariants() -> None:
    p = uniform_partition(4, 3)
    assert isinstance(p, Partition) and p.n_layers == 12 and p.split == 3
    with pytest.raises(PartitionError, match="increase strictly"):
        Partition((1.0, 1.0), (0, 0, 2), ((0, 0), (0, 2)))


def test_next_sub_walks_the_backward_pipeline_and_unit_label_names_units() -> None:
    p = uniform_partition(3, 2)
    chain = [(0, 0)]
    while (nxt := p.next_sub(*chain[-1])) is not None:
        chain.append(nxt)
    assert chain == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert unit_label(3) == "s3" and unit_label(5, 1) == "s5.1" and unit_label(2, -1) == "s2"


def test_rank_assignment_describes_each_ranks_passes() -> None:
    fwd, bwd = sysx_assignment(8, 2, 4).describe()
    assert fwd == "forward stages   r0: s0,s4 | r1: s1,s5 | r2: s2,s6 | r3: s3,s7"
    assert bwd.startswith("backward (owner) r0: s7.1,s5.1,s3.1,s1.1 | r1: s7.0,s5.0,s3.0,s1.0")


def test_the_backward_ring_goes_on_from_the_last_forward_stage_s_rank() -> None:
    """With Nsf not a multiple of Ng (one Block per stage) the backward does not restart at rank 0:
    its first sub-stage (the Head's) runs on the rank after the last forward stage's, and the ring
    brings the last sub-stage back to that same rank."""
    pl = sysx_assignment(5, 1, 2)
    assert pl.fwd_rank == (0, 1, 0, 1, 0)
    assert [pl.bwd_rank[s][0] for s, _ in pl.bwd_order] == [1, 0, 1, 0, 1]
    assert pl.bwd_rank[4][0] == pl.bwd_rank[0][0] == (pl.fwd_rank[4] + 1) % 2
    nine = sysx_assignment(9, 1, 4)  # 9 stages on 4 ranks: the first and last sub-stage on rank 1
    assert nine.bwd_substages(1)[0] == (8, 0) and nine.bwd_substages(1)[-1] == (0, 0)
    for q, (s, k) in enumerate(nine.bwd_order):
        assert nine.bwd_rank[s][k] == sysx_bwd_rank(q, 9, 4) == (9 + q) % 4
