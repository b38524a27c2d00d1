"""The simulator: the paper's unit-cost numbers exactly, memory accounting, physical costs, speed."""

from __future__ import annotations

import json

import pytest

from sysx.partition import uniform_partition
from sysx.schedule import (
    Costs,
    ScheduleError,
    UnitCosts,
    build,
    build_1f1b,
    build_gpipe,
    build_interleaved_1f1b,
    build_mobius,
    build_sysx,
    simulate,
)
from sysx.schedule.draw import chrome_trace


@pytest.mark.parametrize("ng", range(1, 9))
def test_gpipe_and_1f1b_bubble_is_the_paper_formula(ng: int) -> None:
    """Eq. (3) with Tb = 2 Tf: bubble = (Ng-1)/(Nm+Ng-1); DAPPLE's 1F1B has the same bubble."""
    for nm in range(1, 17):
        want_it = (nm + ng - 1) * 3.0
        want = (ng - 1) / (nm + ng - 1)
        for builder in (build_gpipe, build_1f1b):
            tl = simulate(builder(ng, nm), UnitCosts(1.0, 2.0, 0.0), record=False, memory=False)
            assert tl.iteration == want_it
            assert tl.bubble_ratio == pytest.approx(want, abs=1e-12)
            assert tl.busy == [3.0 * nm] * ng


def test_figure_2_mobius_and_figure_8_sysx_unit_costs_exactly() -> None:
    mobius = build_mobius(4, 4, n_stages=8)
    sysx = build_sysx(4, 4, n_stages=8, split=2)
    m0, s0 = simulate(mobius, UnitCosts(1, 2, 0)), simulate(sysx, UnitCosts(1, 2, 0))
    assert (m0.iteration, s0.iteration) == (33.0, 27.0)
    assert m0.bubble_ratio == 9 / 33 and s0.bubble_ratio == 3 / 27  # 27.3 % and 11.1 %
    m6, s6 = simulate(mobius, UnitCosts(1, 2, 6)), simulate(sysx, UnitCosts(1, 2, 6))
    assert (m6.iteration, s6.iteration) == (45.0, 30.0)
    assert m6.bubble_ratio == 21 / 45 and s6.bubble_ratio == 6 / 30  # 46.7 % (paper: 47 %) and 20 %
    assert round(100 * m6.bubble_ratio) == 47
    for tl in (m0, s0, m6, s6):
        assert tl.busy == [24.0] * 4 and tl.bubble == [tl.bubble_ratio] * 4


def test_sysx_ablation_configs_unit_costs() -> None:
    want = {0: (30.0, 42.0), 1: (27.0, 39.0), 2: (27.0, 39.0), 3: (27.0, 30.0)}
    for cfg, (it0, it6) in want.items():
        s = build_sysx(4, 4, n_stages=8, split=2, cfg=cfg)
        assert simulate(s, UnitCosts(1, 2, 0), record=False).iteration == it0
        assert simulate(s, UnitCosts(1, 2, 6), record=False).iteration == it6


def test_sysx_backward_starts_without_a_bubble() -> None:
    """Fig. 8: with sub-stages as long as forwards every GPU computes without a gap."""
    tl = simulate(build_sysx(4, 4, n_stages=8, split=2), UnitCosts(1, 2, 0))
    for r in range(4):
        gpu = sorted((e for e in tl.events if e.rank == r and e.lane == "gpu"), key=lambda e: e.start)
        assert gpu[0].start == r and all(a.end == b.start for a, b in zip(gpu, gpu[1:]))


@pytest.mark.parametrize("ng,nm,v", [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (3, 6, 2), (4, 12, 3)])
def test_interleaved_1f1b_bubble_is_megatrons(ng: int, nm: int, v: int) -> None:
    """Narayanan et al. 2021: bubble time (Ng-1)(tf+tb) per chunk when Nm is a multiple of Ng."""
    tl = simulate(build_interleaved_1f1b(ng, nm, uniform_partition(ng * v)), UnitCosts(1, 2, 0), record=False)
    assert tl.iteration == 3.0 * (v * nm + ng - 1)


def test_same_numbers_with_blocking_rendezvous_sends() -> None:
    for name, kw in [
        ("gpipe", {}),
        ("1f1b", {}),
        ("interleaved_1f1b", {"n_stages": 8}),
        ("mobius", {"n_stages": 8}),
        ("sysx", {"n_stages": 8, "split": 2}),
    ]:
        s = build(name, 4, 4, **kw)
        eager = simulate(s, UnitCosts(1, 2, 6), record=False, memory=False)
        rdv = simulate(s, UnitCosts(1, 2, 6), record=False, memory=False, rendezvous=True)
        assert eager.iteration == rdv.iteration


def test_async_optimizer_workers() -> None:
    s = build_sysx(4, 4, n_stages=8, split=2)
    assert simulate(s, UnitCosts(1, 2, 12)).iteration == 33.0  # last sub-stage ends at 27, steps 6
    # one worker per rank: rank 3's steps (ready at 15, 19, 23, 27, 6 each) queue up
    assert simulate(s, UnitCosts(1, 2, 12, optim_workers=1)).iteration == 39.0
    cpu = [e for e in simulate(s, UnitCosts(1, 2, 12)).events if e.lane == "cpu" and e.rank == 0]
    assert [e.start for e in cpu] == [12.0, 16.0, 20.0, 24.0]  # each as soon as its offload is done


def test_memory_of_afab_and_1f1b_checkpoints() -> None:
    g = simulate(build_gpipe(4, 6), UnitCosts())
    assert g.peak_ckpts == [6.0] * 4  # AFAB keeps every micro-batch's checkpoint
    o = simulate(build_1f1b(4, 6), UnitCosts())
    assert o.peak_ckpts == [4.0, 3.0, 2.0, 1.0]  # 1F1B: at most Ng - r in flight
    for tl in (g, o):
        assert tl.peak_params == [1.0] * 4 and tl.peak_grads == [1.0] * 4
    s = simulate(build_sysx(4, 4, n_stages=8, split=2), UnitCosts())
    assert s.peak_params == [2.0] * 4  # current + prefetched unit
    assert s.peak_grads == [0.5] * 4  # one sub-stage's gradients (1/d of a stage)
    # host: every sub-stage's optimizer state lives with its owner; shared memory: every layer once
    assert sum(s.host) == 8.0 and s.shm == [8.0]
    two = simulate(build_sysx(4, 4, n_stages=8, split=2), UnitCosts(), gpus_per_node=2)
    assert len(two.shm) == 2 and all(x >= 4.0 for x in two.shm)


def _physical(n_layers: int, **kw) -> Costs:
    base = dict(
        layer_fwd_time=(1.0,) * n_layers,
        layer_params=(1e6,) * n_layers,
        act_bytes=1e6,
        layer_act_bytes=(4e6,) * n_layers,
        p2p_latency=0.0,
        p2p_bandwidth=1e6,
        h2d_bandwidth=1e12,
        d2h_bandwidth=1e12,
        optim_params_per_s=1e12,
        allreduce_latency=0.0,
    )
    base.update(kw)
    return Costs(**base)


def test_async_checkpoints_hide_their_transfer() -> None:
    """CFG1 sends checkpoints on the critical path, CFG2 overlaps them (paper §3.1)."""
    part = uniform_partition(8, 2)
    costs = _physical(16, p2p_bandwidth=4e6)  # a transfer = 0.25 s, a layer forward = 1 s
    cfg1 = simulate(build_sysx(4, 4, part, cfg=1), costs, record=False)
    cfg2 = simulate(build_sysx(4, 4, part, cfg=2), costs, record=False)
    assert cfg2.iteration < cfg1.iteration
    ideal = simulate(build_sysx(4, 4, part, cfg=2), _physical(16, p2p_bandwidth=1e15), record=False)
    assert cfg2.iteration - ideal.iteration < cfg1.iteration - ideal.iteration


def test_slow_prefetch_delays_the_first_forward_and_shows_in_the_timeline() -> None:
    part = uniform_partition(4)
    tl = simulate(build_mobius(2, 2, part), _physical(4, h2d_bandwidth=2e6))  # a load = 1 s
    loads = [e for e in tl.events if e.lane == "h2d" and e.rank == 0]
    first_fwd = min(e.start for e in tl.events if e.lane == "gpu" and e.rank == 0)
    assert loads[0].start == 0.0 and loads[0].end == pytest.approx(1.0) and first_fwd == pytest.approx(1.0)
    assert tl.peak_params[0] == pytest.approx(2 * 2e6)  # two stage buffers of 1e6 params x 2 bytes


def test_physical_costs_are_checked() -> None:
    with pytest.raises(ValueError, match="3 layer_params for 2 layer_fwd_time"):
        Costs(layer_fwd_time=(1.0, 1.0), layer_params=(1.0,) * 3, act_bytes=1.0)
    with pytest.raises(ValueError, match="p2p_bandwidth=0"):
        _physical(2, p2p_bandwidth=0)
    with pytest.raises(ValueError, match="partition has 4 layers but the costs describe 2"):
        simulate(build_gpipe(2, 2, uniform_partition(2, 1, 2)), _physical(2))


def test_model_costs_end_to_end() -> None:
    from sysx.model import get_preset
    from sysx.partition import partition_model
    from sysx.schedule import costs_from_model

    cfg = get_preset("llama2_10b")
    costs = costs_from_model(cfg, 2048, 2, gpu_flops=60e12, optim_params_per_s=1e9)
    part = partition_model(cfg, 2048, 8, split=2)
    sysx = simulate(build_sysx(4, 8, part), costs)
    mob = simulate(build_mobius(4, 8, part.with_split(1)), costs)
    assert sysx.iteration < mob.iteration
    assert sum(sysx.host) == pytest.approx(16.0 * sum(costs.layer_params))
    assert 1 << 30 < max(sysx.peak_gpu) < max(mob.peak_gpu)  # fine-grained sub-stages need less GPU memory


def test_deadlocked_lists_raise_in_simulate_too() -> None:
    s = build_gpipe(2, 2)
    lists = [list(x) for x in s.ops]
    lists[0] = [op for op in lists[0] if op.kind.name != "SEND_ACT"]
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(s.with_ops(lists))


def test_summary_and_chrome_trace(tmp_path) -> None:
    tl = simulate(build_sysx(2, 2, n_stages=4, split=2), UnitCosts(1, 2, 4))
    data = json.loads(json.dumps(tl.summary()))
    assert data["iteration"] == tl.iteration and len(data["busy"]) == 2
    path = chrome_trace(tl, tmp_path / "t.json")
    trace = json.loads(path.read_text())
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == len(tl.events) and {"gpu", "cpu"} <= {e["cat"] for e in boxes}
    assert max(e["ts"] + e["dur"] for e in boxes) == pytest.approx(tl.iteration * 1000)


def test_simulate_leaves_no_reference_cycles() -> None:
    """A run's state is freed by reference counting: handlers bound on the engine once made it a
    cycle that only the garbage collector freed, with every list of the run (slower, memory held)."""
    import gc

    s = build_sysx(4, 4, n_stages=8, split=2)
    simulate(s)
    gc.collect()
    gc.disable()
    try:
        simulate(s)
        simulate(s, UnitCosts(1, 2, 3), record=False)
        assert gc.collect() == 0
    finally:
        gc.enable()
