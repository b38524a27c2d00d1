"""The saved-activation policy: the AdaWS DP (vs. brute force and hand-derived optima, with the
ring-capacity and host constraints), the forward-pass simulator, and PyAO's IQR rule."""

from __future__ import annotations

import random

import pytest

from sysx.single.act_policy import (
    CATEGORIES,
    LEVEL_NAMES,
    N_LEVELS,
    SaveProblem,
    brute_force_levels,
    iqr_upper_fence,
    level_categories,
    parse_level,
    pyao_recompute_mask,
    simulate_forward,
    solve_save_levels,
)


def test_levels_are_nested_from_input_only_to_everything() -> None:
    assert N_LEVELS >= 4
    assert LEVEL_NAMES[0] == "input" and LEVEL_NAMES[-1] == "everything"
    assert level_categories(0) == frozenset()
    assert level_categories(N_LEVELS - 1) == frozenset(CATEGORIES)
    for level in range(1, N_LEVELS):
        assert level_categories(level - 1) < level_categories(level)
    assert parse_level("matmuls") == 3 and parse_level("2") == 2 and parse_level(4) == 4
    with pytest.raises(ValueError, match="unknown save level"):
        parse_level("most")
    with pytest.raises(ValueError, match="out of range"):
        parse_level(N_LEVELS)


def test_simulator_counts_the_stall_of_a_slot_not_yet_drained() -> None:
    # one slot, compute 1 s per layer, each copy 0.5 s: layers 1 and 2 each wait 0.5 s for the slot
    p = SaveProblem.make([1.0, 1.0, 1.0], [[0.5]] * 3, [[0.0]] * 3, ring_slots=1)
    ok, stall, finish, _ = simulate_forward(p, [0, 0, 0])
    assert not ok
    assert stall == pytest.approx(1.0)
    assert finish == pytest.approx([1.5, 3.0, 4.5])
    # two slots: each copy has a whole layer of compute to finish -> no stall (the last layer stays on
    # the device, as the executor's last window does)
    p2 = SaveProblem.make([1.0, 1.0, 1.0], [[0.5]] * 2, [[0.0]] * 2, ring_slots=2, transfer_layers=2)
    ok2, stall2, _, _ = simulate_forward(p2, [0, 0])
    assert ok2 and stall2 == 0.0
    # a copy still running when the forward pass ends is not drained in time for backward either
    p3 = SaveProblem.make([1.0, 1.0, 1.0], [[0.5]] * 3, [[0.0]] * 3, ring_slots=2)
    ok3, stall3, _, _ = simulate_forward(p3, [0, 0, 0])
    assert not ok3 and stall3 == 0.0


def test_unlimited_bandwidth_saves_everything() -> None:
    L = 6
    p = SaveProblem.make([1.0] * L, [[0.0, 0.0, 0.0, 0.0]] * L, [[0.0, 1.0, 2.0, 3.0]] * L, ring_slots=2)
    sol = solve_save_levels(p)
    assert sol.feasible and sol.exact
    assert sol.levels == (3,) * L
    assert sol.value == pytest.approx(3.0 * L)


def test_ring_of_one_slot_cannot_drain_any_copy_in_time() -> None:
    # with R_act = 1 a copy must end before the next unit starts, i.e. at the instant it may begin
    p = SaveProblem.make([1.0] * 4, [[0.1, 0.5]] * 4, [[0.0, 1.0]] * 4, ring_slots=1)
    sol = solve_save_levels(p)
    assert not sol.feasible
    assert sol.levels == (0, 0, 0, 0)
    assert sol.stall_s == pytest.approx(0.3)  # layers 1..3 each wait 0.1 s


def test_ring_capacity_caps_the_sustainable_transfer_per_layer() -> None:
    # R_act = 2, compute 1 s/layer: a copy may take at most the next layer's compute (1 s) on average.
    # option 2 (1.2 s) never fits; option 1 (0.6 s) always does -> optimum is option 1 everywhere.
    # (the last layer is the window: it keeps its activations on the device)
    L = 5
    p = SaveProblem.make(
        [1.0] * L, [[0.2, 0.6, 1.2]] * (L - 1), [[0.0, 1.0, 3.0]] * (L - 1), ring_slots=2, transfer_layers=L - 1
    )
    sol = solve_save_levels(p)
    assert sol.feasible and sol.levels == (1,) * (L - 1) and sol.value == pytest.approx(L - 1)
    assert brute_force_levels(p)[1] == pytest.approx(sol.value)


def test_a_bigger_ring_lets_a_backlog_build_and_drain() -> None:
    # R_act = 3: copies of 1.6 s can alternate with short ones (backlog absorbed by the slack);
    # the DP must find the alternation the brute force finds.
    L, n_tr = 8, 6
    p = SaveProblem.make([1.0] * L, [[0.1, 1.6]] * n_tr, [[0.0, 1.0]] * n_tr, ring_slots=3, transfer_layers=n_tr)
    best, value = brute_force_levels(p)
    sol = solve_save_levels(p)
    assert sol.feasible and sol.value == pytest.approx(value)
    assert 0 < sum(sol.levels) < n_tr  # neither all-high nor all-low
    assert simulate_forward(p, sol.levels)[0]
    assert best is not None


def test_host_capacity_limits_the_bytes_kept_at_home() -> None:
    # unlimited bandwidth, but the host holds only 2 layers' worth of the big option
    L = 5
    p = SaveProblem.make(
        [1.0] * L,
        [[0.0, 0.0]] * L,
        [[0.0, 1.0]] * L,
        ring_slots=2,
        host_bytes=[[1.0, 10.0]] * L,
        host_capacity=2 * 10.0 + 3 * 1.0,
    )
    sol = solve_save_levels(p)
    assert sol.feasible and sol.levels.count(1) == 2 and sol.value == pytest.approx(2.0)
    assert sol.host_bytes <= 23.0
    assert brute_force_levels(p)[1] == pytest.approx(2.0)


def test_window_layers_keep_their_activations_on_the_device() -> None:
    # only the first 3 of 5 layers transfer; the last 2 occupy slots but never copy
    p = SaveProblem.make([1.0] * 5, [[0.1, 0.9]] * 3, [[0.0, 1.0]] * 3, ring_slots=2, transfer_layers=3)
    sol = solve_save_levels(p)
    assert len(sol.levels) == 3 and sol.feasible
    assert sol.value == pytest.approx(brute_force_levels(p)[1])


@pytest.mark.parametrize("seed", range(24))
def test_dp_matches_brute_force_on_random_small_problems(seed: int) -> None:
    rng = random.Random(seed)
    L = rng.randint(2, 5)
    n_opts = rng.randint(2, 4)
    chunks = rng.choice([1, 2])
    ring = rng.randint(1, 4) * chunks
    compute = [rng.uniform(0.5, 1.5) for _ in range(L)]
    transfer, value, host = [], [], []
    for _ in range(L):
        t = sorted(rng.uniform(0.0, 1.2) / chunks for _ in range(n_opts))
        v = sorted(rng.uniform(0.0, 2.0) for _ in range(n_opts))
        transfer.append(t)
        value.append(v)
        host.append([x * 10 for x in t])
    cap = rng.choice([None, sum(min(h) for h in host) * chunks * rng.uniform(1.0, 3.0)])
    n_tr = rng.randint(1, L)
    p = SaveProblem.make(
        compute,
        transfer[:n_tr],
        value[:n_tr],
        ring_slots=ring,
        chunks=chunks,
        transfer_layers=n_tr,
        host_bytes=host[:n_tr],
        host_capacity=cap,
    )
    best, best_value = brute_force_levels(p)
    sol = solve_save_levels(p)
    if best is None:
        assert not sol.feasible
    else:
        assert sol.feasible and sol.exact
        assert sol.value == pytest.approx(best_value, rel=1e-9, abs=1e-12)
        assert simulate_forward(p, sol.levels)[0]


def test_dp_solves_a_real_model_size() -> None:
    # 80 transferring blocks, 5 options, 4 chunks per round; its speed is profiling/bench_planners.py's
    n_tr, W, n_opts, chunks = 80, 8, 5, 4
    p = SaveProblem.make(
        [1.0] * (n_tr + W),
        [[0.12 * o for o in range(1, n_opts + 1)]] * n_tr,
        [[float(o) for o in range(n_opts)]] * n_tr,
        ring_slots=W * chunks,
        chunks=chunks,
        transfer_layers=n_tr,
        host_bytes=[[float(o + 1) for o in range(n_opts)]] * n_tr,
        host_capacity=3.0 * n_tr * chunks,
    )
    sol = solve_save_levels(p)
    assert sol.feasible and simulate_forward(p, sol.levels)[0]


def test_iqr_fence_and_pyao_rule() -> None:
    assert iqr_upper_fence([1, 2, 3, 4, 100]) == pytest.approx(4 + 1.5 * 2)
    throughput = [1.0, 2.0, 3.0, 4.0, 100.0]
    # the outlier is recomputed only when it also outruns the link
    assert pyao_recompute_mask(throughput, link_bytes_per_s=50.0) == [False, False, False, False, True]
    assert pyao_recompute_mask(throughput, link_bytes_per_s=200.0) == [False] * 5
    # identical layers: no spread, no outlier
    assert pyao_recompute_mask([5.0] * 6, link_bytes_per_s=1.0) == [False] * 6
    with pytest.raises(ValueError):
        iqr_upper_fence([])
