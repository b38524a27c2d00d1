"""Host costs the layer times leave out (issue 27, point 3): the simulator charges the executor's
per-instruction cost and the per-message latency, the host plan holds the fixed per-process bytes,
and the machine's figures are measured and cached with its hardware profile."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from sysx.autotune.check import HOST, predict
from sysx.machine import hardware_cache
from sysx.machine.hardware import HardwareProfile
from sysx.machine.host_cost import measure_op_host_s
from sysx.schedule import UnitCosts, build_gpipe, simulate
from sysx.single.hardware import assumed_hardware
from sysx.single.plan_costs import round_host_s


def test_every_instruction_pays_the_host_cost_on_its_ranks_cursor() -> None:
    """gpipe, 2 ranks, 1 micro-batch, F=1, B=2, h=0.25 per instruction, eager sends of 0 s (by hand):
    r0 LOAD .25, F .5-1.5, SEND 1.75; r1 LOAD .25, RECV_ACT .5 waits to 1.75, F 2-3, B 3.25-5.25,
    OFFLOAD 5.5, FREE 5.75, SEND_GRAD 6; r0 RECV_GRAD 2 waits to 6, B 6.25-8.25, OFFLOAD 8.5,
    FREE 8.75, VALIDATE 9, OPT 9.25."""
    sched = build_gpipe(2, 1)
    table = UnitCosts(1.0, 2.0, 0.0).table(sched)
    assert simulate(sched, table, record=False).iteration == 6.0
    tl = simulate(sched, dataclasses.replace(table, op_host=0.25), record=True)
    assert tl.iteration == pytest.approx(9.25)
    first_fwd = next(e for e in tl.events if e.rank == 0 and e.lane == "gpu")
    assert (first_fwd.start, first_fwd.end) == (pytest.approx(0.5), pytest.approx(1.5))
    # a per-message latency of 0.5 on both messages (eager: the sender's cursor carries it too):
    # r1 F starts at 2.5 instead of 2, SEND_GRAD arrives at 7, r0's B runs 7.25-9.25, ... OPT 10.25
    msgs = dataclasses.replace(table, op_host=0.25, act_xfer=[0.5, 0.5], grad_xfer=[0.5, 0.5])
    assert simulate(sched, msgs, record=False).iteration == pytest.approx(10.25)


def test_the_host_plan_holds_each_process_and_the_check_counts_every_replica() -> None:
    sched = build_gpipe(2, 2)
    table = UnitCosts().table(sched)
    base = simulate(sched, table, record=False)
    fixed = simulate(sched, dataclasses.replace(table, process_bytes=30.0), record=False)
    assert [b - a for a, b in zip(base.host, fixed.host)] == [30.0, 30.0]
    one = predict(sched, dataclasses.replace(table, process_bytes=30.0), memory=HOST, source="t").peak_bytes
    assert one == pytest.approx(sum(fixed.host) + sum(fixed.peak_gpu) + sum(fixed.shm))
    # two replicas: the state sharded between them (the same total), but each replica's two ranks
    # hold their own process bytes and device buffers; the node's shared copy counts once
    two = predict(sched, dataclasses.replace(table, process_bytes=30.0, replicas=2), memory=HOST, source="t")
    assert two.peak_bytes == pytest.approx(one + 2 * 30.0 + sum(fixed.peak_gpu))


def test_the_single_planner_charges_the_host_cost_per_round() -> None:
    hw = dataclasses.replace(assumed_hardware("v100"), op_host_s=1e-4)
    assert round_host_s(hw, 4, 2) == pytest.approx(1e-4 * 4 * (2 * 2 + 3))
    assert round_host_s(assumed_hardware("v100"), 4, 2) == 0.0  # assumed profiles carry no host cost


def test_the_per_op_host_cost_is_measured_positive_and_small() -> None:
    seconds = measure_op_host_s(repeats=2)
    assert 0 < seconds < 0.01


def test_host_costs_are_cached_with_the_hardware_and_old_caches_measured_again(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SYSX_CACHE_DIR", str(tmp_path))
    calls: list[int] = []
    monkeypatch.setattr(hardware_cache, "measure_process_bytes", lambda: calls.append(1) or 25 << 20)
    cpu = torch.device("cpu")
    # a cache file of the version before the host costs: another name, never read
    old = hardware_cache.hardware_path(cpu, torch.float32).with_name("hardware-v3-old-float32.json")
    old.parent.mkdir(parents=True, exist_ok=True)
    old.write_text(json.dumps({"name": "old"}))
    first, reused = hardware_cache.load_or_measure_hardware(cpu, repeats=1)
    assert not reused and first.op_host_s > 0 and first.process_bytes == 25 << 20 and calls == [1]
    again, reused = hardware_cache.load_or_measure_hardware(cpu, repeats=1)
    assert reused and (again.op_host_s, again.process_bytes) == (first.op_host_s, first.process_bytes)
    assert calls == [1]  # the fresh process ran once per machine
    # a profile written without the new fields reads with no host cost (assumed profiles do too)
    fields = {k: v for k, v in first.as_dict().items() if k not in ("op_host_s", "process_bytes")}
    assert HardwareProfile(**fields).op_host_s == 0.0


def test_the_host_growth_starts_at_the_reset_peak_and_counts_shared_pages_once() -> None:
    from multiprocessing import shared_memory

    from sysx.trainers.prediction import host_growth, start_host_peak

    spike = torch.ones(48 << 18)  # 48 MiB touched, then freed: a peak before the state existed
    del spike
    rss0 = start_host_peak()
    assert host_growth(rss0) < 24 << 20  # the earlier spike is not the state's peak
    seg = shared_memory.SharedMemory(create=True, size=16 << 20)
    try:
        seg.buf[::4096] = b"\1" * len(seg.buf[::4096])  # one mapper: its PSS is its RSS
        grown = host_growth(rss0)
        assert 14 << 20 < grown < 40 << 20
    finally:
        seg.close()
        seg.unlink()


def test_the_check_counts_the_replicas_landing_buffers() -> None:
    """fp32 with 2 replicas on one node: every owned unit's gradients land in a buffer per replica,
    one of which doubles as the owner's shard gradients: one extra fp32 copy of the model."""
    from sysx.autotune.replicas import landing_bytes
    from sysx.model import get_preset
    from sysx.partition import partition_layers
    from sysx.schedule.costs import costs_from_model

    cfg = get_preset("tiny")
    sched = build_gpipe(2, 2, partition_layers([1.0] * (cfg.n_layers + 2), 2))
    costs = costs_from_model(cfg, 16, 1, dtype_bytes=4)
    model_bytes = 4 * sum(costs.layer_params)
    assert landing_bytes(sched, costs.layer_params, 2, 4, work_dtype="float32") == pytest.approx(model_bytes)
    assert landing_bytes(sched, costs.layer_params, 1, 2, work_dtype="float32") == 0.0
    one = predict(sched, costs, memory=HOST, source="t", gpus_per_node=2).peak_bytes
    table_only = predict(sched, costs.table(sched), memory=HOST, source="t", gpus_per_node=2).peak_bytes
    assert one == pytest.approx(table_only)  # one replica: no landing buffer in fp32


def test_the_step_allreduces_cost_the_measured_latency_per_ring_hop() -> None:
    from sysx.autotune.costs import ALLREDUCES_PER_STEP, step_allreduces

    assert step_allreduces(1, 1e-4) == 0.0
    assert step_allreduces(4, 1e-4) == pytest.approx(ALLREDUCES_PER_STEP * 2 * 3 * 1e-4)
