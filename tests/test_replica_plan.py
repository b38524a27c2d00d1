"""Replicas in the plan: the cost table, the simulated reduce lane and exchange (pure data)."""

from __future__ import annotations

import dataclasses

import pytest

from sysx.model import get_preset
from sysx.partition import partition_model
from sysx.schedule import build
from sysx.schedule.costs import costs_from_model
from sysx.schedule.replica_costs import ReplicaCosts
from sysx.schedule.simulate import simulate

LINK, LAT, MEM = 10e9, 1e-5, 4e9


@pytest.fixture(scope="module")
def setting():
    cfg = dataclasses.replace(get_preset("tiny"), n_layers=10)
    part = partition_model(cfg, 256, 4, split=2, n_ranks=2)
    sched = build("sysx", 2, 4, part, n_stages=4, split=2)
    costs = costs_from_model(cfg, 256, 1, gpu_flops=1e9, optim_params_per_s=2e5, optim_workers=2)
    return sched, costs


def _with(costs, replicas: int, share_node: bool):
    return dataclasses.replace(costs, replica=ReplicaCosts(replicas, share_node, LINK, LAT, MEM))


def test_one_replica_is_the_plain_table(setting):
    sched, costs = setting
    plain = costs.table(sched)
    assert _with(costs, 1, False).table(sched) == plain
    assert simulate(sched, _with(costs, 1, False)).iteration == simulate(sched, plain).iteration


def test_between_nodes_reduce_scatter_sharded_optimizer_and_exchange(setting):
    sched, costs = setting
    plain, tab = costs.table(sched), _with(costs, 2, False).table(sched)
    assert tab.opt == [x / 2 for x in plain.opt]
    assert tab.reduce == pytest.approx([LAT + 0.5 * n * 4 / LINK for n in plain.params_sub])
    for r in range(sched.n_ranks):
        owned = sum(plain.params_sub[s * 2 + k] for s, k in sched.assignment.bwd_substages(r))
        assert tab.gather[r] == pytest.approx(LAT + 0.5 * owned * 2 / LINK)


def test_on_one_node_reduce_through_memory_no_exchange(setting):
    sched, costs = setting
    plain, tab = costs.table(sched), _with(costs, 4, True).table(sched)
    assert tab.reduce == pytest.approx([n / 4 * 5 * 4 / MEM for n in plain.params_sub])
    assert tab.gather == [0.0] * sched.n_ranks
    assert tab.opt == [x / 4 for x in plain.opt]


def test_reduce_lane_orders_offload_reduce_step_and_exchange(setting):
    sched, costs = setting
    tl = simulate(sched, _with(costs, 2, False))
    plain = simulate(sched, costs)
    assert tl.host == pytest.approx([h / 2 for h in plain.host])
    d = sched.split
    for r in range(sched.n_ranks):
        ev = {lane: [e for e in tl.events if e.rank == r and e.lane == lane] for lane in ("d2h", "reduce", "cpu")}
        reduces = [e for e in ev["reduce"] if e.op.kind.name == "OFFLOAD_GRADS"]
        assert [e.op.stage * d + e.op.sub for e in reduces] == [e.op.stage * d + e.op.sub for e in ev["d2h"]]
        for off, red in zip(ev["d2h"], reduces):
            assert red.start >= off.end - 1e-12
            step = next(e for e in ev["cpu"] if (e.op.stage, e.op.sub) == (red.op.stage, red.op.sub))
            assert step.start >= red.end - 1e-12
        for a, b in zip(reduces, reduces[1:]):  # one reducer thread: one unit at a time
            assert b.start >= a.end - 1e-12
        (gather,) = [e for e in ev["reduce"] if e.op.kind.name == "VALIDATE"]
        assert gather.start >= max(e.end for e in ev["cpu"]) - 1e-12
        assert gather.end <= tl.iteration + 1e-12
    assert tl.iteration > max(e.end for e in tl.events if e.lane == "cpu")


def test_slow_reduction_delays_the_validation(setting):
    sched, costs = setting
    slow = dataclasses.replace(costs, replica=ReplicaCosts(2, True, LINK, LAT, 1.0))  # 1 byte/s
    tl = simulate(sched, slow)
    last_reduce = max(e.end for e in tl.events if e.lane == "reduce")
    assert tl.iteration >= last_reduce


# --- the host memory of a node -----------------------------------------------------------------
def _units(sched, numels):
    from sysx.memory.node_plan import UnitPlace

    p, place = sched.partition, sched.assignment
    return [
        UnitPlace(sum(numels[i] for i in p.sub_layers(s, k)), place.bwd_rank[s][k], place.fwd_rank[s])
        for s in range(p.n_stages)
        for k in range(p.split)
    ]


@pytest.mark.parametrize("dtype,rollback", [("bfloat16", "undo"), ("float32", "exact"), ("bfloat16", "snapshot")])
def test_node_plan_of_one_replica_is_the_plain_plan(setting, dtype, rollback):
    from sysx.memory.budget import plan_host_memory
    from sysx.memory.node_plan import node_host_memory
    from sysx.replicas import ReplicaLayout

    sched, costs = setting
    units = _units(sched, [int(x) for x in costs.layer_params])
    layout = ReplicaLayout(1, 2, 0, local_world_size=1)  # two nodes of one rank: rank 1's forwards mirror
    for node in (0, 1):
        owned = [(u.numel, dtype) for u in units if u.owner == node]
        mirrors = [(u.numel, dtype) for u in units if u.fwd == node and u.owner != node]
        pinned = 0 if dtype == "float32" else 2 * sum(n for n, _ in owned)
        expect = plan_host_memory(owned, mirrors=mirrors, pinned_bytes=pinned, rollback=rollback)
        assert node_host_memory(units, layout, node, dtype, rollback=rollback) == expect


def test_two_replicas_across_nodes_halve_the_optimizer_state(setting):
    from sysx.memory.node_plan import node_host_memory, optimizer_bytes
    from sysx.replicas import ReplicaLayout

    sched, costs = setting
    units = _units(sched, [int(x) for x in costs.layer_params])
    one = node_host_memory(units, ReplicaLayout(1, 2, 0, local_world_size=2), 0, "bfloat16")
    for node in (0, 1):  # R=2 x P=2 on two nodes of two GPUs: each node holds a whole pipeline
        two = node_host_memory(units, ReplicaLayout(2, 2, 0, local_world_size=2), node, "bfloat16")
        assert two.shared == one.shared and two.pinned == one.pinned
        assert optimizer_bytes(two) <= 0.5 * optimizer_bytes(one) + 64
        assert optimizer_bytes(two) <= 0.6 * optimizer_bytes(one)


def test_replicas_on_one_node_share_the_working_copy(setting):
    from sysx.memory.node_plan import node_host_memory, optimizer_bytes
    from sysx.replicas import ReplicaLayout

    sched, costs = setting
    units = _units(sched, [int(x) for x in costs.layer_params])
    one = node_host_memory(units, ReplicaLayout(1, 2, 0, local_world_size=2), 0, "float32")
    two = node_host_memory(units, ReplicaLayout(2, 2, 0, local_world_size=4), 0, "float32")
    assert two.shared == one.shared and two.segments == one.segments  # one segment per unit per node
    assert optimizer_bytes(two) == optimizer_bytes(one)  # two ranks own one half each
    # a full fp32 landing buffer per owner rank, whose own shard's slice is the optimizer's gradients
    assert two.pinned == (2 - 1) * 4 * sum(u.numel for u in units)


def test_check_refuses_a_world_that_is_no_multiple_of_the_replicas(tmp_path, capsys):
    from sysx.train import main

    argv = ["--check", "--ranks", "3", "parallel.replicas=2", "schedule=sysx", "device=cpu", f"run_dir={tmp_path}/r"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "parallel.replicas=2 does not divide the 3 processes" in err
    assert main(argv[:2] + ["4"] + argv[3:]) == 0
    assert "stages on 2 rank(s) x 2 replicas" in capsys.readouterr().out


# --- the emulated device's replica hooks ---------------------------------------------------------
def _emulated(replicas: int, ranks: int, time_scale: float = 1e-6):
    from sysx.config import EmulateSection, EvalSection, ModelSection, SysxConfig, TrainSection, validate
    from sysx.emulate import emulated_model, plan_emulation
    from sysx.runtime import PipelineOptions
    from sysx.runtime.options import make_schedule

    cfg = SysxConfig(
        model=ModelSection(preset="tiny"),
        device="emulated",
        eval=EvalSection(every=0),
        train=TrainSection(steps=3, micro_batch_size=1, micro_batches=2, seq_len=16),
        emulate=EmulateSection(model="llama2_7b", seq_len=2048, micro_batch_size=1, time_scale=time_scale),
    )
    validate(cfg)
    model = emulated_model(cfg)
    schedule = make_schedule(
        PipelineOptions(schedule="sysx", optim_backend="torch"), model.config, n_ranks=ranks, n_micro=2, seq_len=2048
    )
    return plan_emulation(cfg, schedule, backend="torch", replicas=replicas), schedule


def _event(at: float):
    from sysx.emulate import EmulatedEvent

    event = EmulatedEvent()
    event.time = at
    return event


def test_emulated_plan_of_replicas_across_and_within_nodes():
    one, _ = _emulated(1, 4)
    across, _ = _emulated(2, 4)  # 4 GPUs per node: each replica's pipeline fills a node
    within, _ = _emulated(2, 2)  # two 2-rank pipelines on one node
    assert across.table.opt == pytest.approx([x / 2 for x in one.table.opt])
    assert across.table.reduce and all(g > 0 for g in across.table.gather)
    assert within.table.reduce and within.table.gather == [0.0, 0.0]
    assert across.timeline.replicas == 2 and one.table.reduce == [] and one.table.gather == []
    assert across.timeline.host == pytest.approx([h / 2 for h in one.timeline.host])


def test_pacer_reduces_in_unit_order_then_steps_the_shard_then_gathers():
    import time

    from sysx.emulate import EmulatedPacer
    from sysx.partition import unit_label

    scale = 1e-6  # modelled durations of ~1e-7 s; the clock's float64 steps near its value are ~2e-12 s
    plan, sched = _emulated(2, 4, scale)
    rank = 1
    pacer = EmulatedPacer(plan, sched, 4 + rank, time_scale=scale, stage_rank=rank)  # replica 1's pipeline rank 1
    d, tab = sched.split, plan.table
    units = sched.assignment.bwd_substages(rank)[:2]
    names = [unit_label(s, k) for s, k in units]
    pacer.begin_step(0)
    now = time.monotonic()
    offloaded = [now, now + 1e-9]  # the second offload ends before the first reduction: it queues
    for name, at in zip(names, offloaded):
        with pacer.replica_reduce(name, _event(at)):
            pass
    reduces = [sp for sp in pacer._stats.spans if sp[0] == "reduce"]
    seconds = [tab.reduce[s * d + k] * scale for s, k in units]
    assert reduces[0][2:] == pytest.approx((offloaded[0], offloaded[0] + seconds[0]), abs=1e-9)
    assert reduces[1][2] == pytest.approx(reduces[0][3], abs=1e-9)  # one reducer thread
    assert reduces[1][3] - reduces[1][2] == pytest.approx(seconds[1], abs=1e-9)
    with pacer.optimizer_pace()(names[1], _event(offloaded[1])):
        pass
    (step,) = [sp for sp in pacer._stats.spans if sp[0] == "cpu"]
    s1, k1 = units[1]
    assert step[2] == pytest.approx(reduces[1][3], abs=1e-9)  # the shard's step waits for its reduction
    assert step[3] - step[2] == pytest.approx(tab.opt[s1 * d + k1] * scale, abs=1e-9)
    with pacer.replica_gather(12345):
        pass
    (gather,) = [sp for sp in pacer._stats.spans if sp[1] == "GATHER"]
    assert gather[2] >= step[3] - 1e-9
    assert gather[3] - gather[2] == pytest.approx(tab.gather[rank] * scale, abs=1e-9)
    assert pacer.compute.free == gather[3]
    pacer.end_step(1e-3)
    assert pacer.steps[0].ratios["reduce"].n == 3  # two reductions and the exchange
    from sysx.emulate.report import span_seconds

    reduced = sum(tab.reduce[s * d + k] for s, k in units)
    assert span_seconds([pacer.steps], [0], "RED ", scale) == pytest.approx(reduced, rel=1e-4)
    assert span_seconds([pacer.steps], [0], "GATHER", scale) == pytest.approx(tab.gather[rank], rel=1e-4)


def test_one_replica_pacer_hooks_add_nothing():
    from sysx.emulate import EmulatedPacer

    plan, sched = _emulated(1, 2)
    pacer = EmulatedPacer(plan, sched, 0, time_scale=1e-6)
    pacer.begin_step(0)
    with pacer.replica_reduce("s0.0", None), pacer.replica_gather(0):
        pass
    assert [sp[3] - sp[2] for sp in pacer._stats.spans] == [0.0, 0.0]
    assert pacer._stats.late < 1.0  # no event: from when it was entered, not from the clock's zero


# --- sysx plan ---------------------------------------------------------------------------------
EMULATED_10B = [
    "device=emulated",
    "model=tiny",
    "emulate.model=llama2_10b",
    "emulate.seq_len=2048",
    "emulate.micro_batch_size=2",
    "train.seq_len=16",
    "precision=bf16",
    "optim.backend=torch",
]


def _plan_json(capsys, *argv: str) -> dict:
    import json

    from sysx.plan_command import main

    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_of_two_replicas_doubles_the_throughput_and_halves_the_optimizer_memory(capsys):
    one = _plan_json(capsys, "--ranks", "4", "--hydra", *EMULATED_10B, "train.micro_batches=8")
    two = _plan_json(capsys, "--ranks", "8", "--hydra", *EMULATED_10B, "train.micro_batches=8", "parallel.replicas=2")
    assert "replica_plan" not in one and two["ranks"] == 4 and two["replicas"] == 2
    rp = two["replica_plan"]
    assert rp["replicas"] == 2 and rp["pipeline_ranks"] == 4 and not rp["peers_share_node"]
    assert rp["tokens_per_step"] == 2 * 8 * 2 * 2048 and rp["reduce_exposed_s"] >= 0 and rp["gather_exposed_s"] > 0
    assert rp["tokens_per_s"] >= 1.8 * (8 * 2 * 2048 / one["iteration"])
    assert rp["optimizer_ratio"] <= 0.6


def test_plan_refuses_replicas_that_do_not_divide_the_ranks(capsys):
    from sysx.plan_command import main

    assert main(["--ranks", "6", "--replicas", "4", "--model", "llama2_7b"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "parallel.replicas=4 does not divide the 6 processes" in err


def test_plan_of_model_replicas_on_one_node_prints_its_block(capsys):
    from sysx.plan_command import main

    assert main(["--ranks", "4", "--replicas", "2", "--model", "llama2_7b", "-m", "4"]) == 0
    out = capsys.readouterr().out
    assert "replicas: 2 x 2-rank pipeline (4 ranks; peers on one node" in out
    # both replicas' shards on the node: its optimizer state is one pipeline's (each rank's is half)
    assert "tokens per modelled second" in out and "1.00x" in out


# --- the tuner -----------------------------------------------------------------------------------
def _tuning_job(replicas: int | None):
    import torch

    from sysx.autotune.apply import job_from_config, job_profile
    from sysx.config import EmulateSection, ModelSection, SysxConfig, TrainSection, validate
    from sysx.config.sections import ParallelSection

    cfg = SysxConfig(
        model=ModelSection(preset="tiny"),
        device="emulated",
        precision="bf16",
        parallel=ParallelSection(replicas=replicas),
        train=TrainSection(micro_batch_size=1, micro_batches=16 // (replicas or 1), seq_len=16),
        emulate=EmulateSection(model="llama2_10b", seq_len=2048, micro_batch_size=2),
    )
    validate(cfg)
    job = job_from_config(cfg, 8, 4, torch.device("cpu"))  # 2 emulated nodes of 4 V100
    return job, job_profile(cfg, job)


def _search(job, profile, host_gib: float):
    from sysx.autotune.search import Budget, Space, search

    space = Space(
        stages_per_rank=(2,), splits=(3,), cfgs=(3,), param_buffers=(2,), micro_batch_sizes=(2,), optimizer_workers=(1,)
    )
    return search(job, Budget(32 * 2**30, host_gib * 2**30, 512 * 2**30), profile, space)


def test_tuner_searches_replicas_and_keeps_the_global_batch():
    from sysx.autotune.apply import choice
    from sysx.autotune.report import global_batch_phrase

    job, profile = _tuning_job(None)
    assert job.replicas is None and job.global_batch == 32
    result = _search(job, profile, 512)
    assert {c.replicas for c in result.fitting} == {1, 2, 4, 8}
    assert all(c.global_batch == 32 for c in result.fitting)
    best = result.best
    assert best is not None and best.replicas == 2 and "parallel.replicas=2" in best.label()
    keys = choice(best, emulated=True)
    assert keys["parallel.replicas"] == 2 and keys["train.micro_batches"] == 8
    assert global_batch_phrase(result) == (
        "global batch 32 sequences in every candidate (the winner's: 2 replicas x 16 sequences)"
    )


def test_tuner_refuses_replicas_whose_node_memory_does_not_fit():
    job, profile = _tuning_job(None)
    result = _search(job, profile, 77)  # one 8-rank pipeline needs 75.6 GiB a node, replicas 78.1 (the working copy)
    assert result.best is not None and result.best.replicas == 1
    assert {c.replicas for c in result.rejected} == {2, 4, 8}
    assert all(c.over["host"] > 1 for c in result.rejected)


def test_tuner_with_fixed_replicas_searches_only_them():
    from sysx.autotune.report import why

    job, profile = _tuning_job(2)
    assert job.replicas == 2 and job.global_batch == 32
    result = _search(job, profile, 512)
    assert {c.replicas for c in result.fitting} == {2}
    # the job's global batch, not one replica's (what the schedule.tune line prints)
    assert "global batch 32 sequences (2 replicas x 16 sequences) in every candidate" in why(result, None)[0]


# --- the benchmark's replica rows -----------------------------------------------------------------
def _bench():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_pipeline", Path(__file__).parents[1] / "profiling" / "bench_pipeline.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_row(ranks: int, it: float, replicas: int = 1) -> dict:
    report = {
        "plan": {"iteration_s": it, "bubble": 0.1},
        "measured": {"iteration_s": it, "bubble": 0.1, "over_plan": 1.0},
    }
    row = {"model": "llama2_10b", "seq": 2048, "ranks": ranks, "schedule": "sysx:cfg3", "report": report}
    return {**row, "replicas": replicas} if replicas > 1 else row


def test_bench_replica_rows_run_beside_the_long_pipeline_and_compare_throughput():
    bench = _bench()
    cells = bench.replica_cells(["10b"], "2048", ["sysx:cfg3"], "2")
    assert cells == {
        8: [
            {"model": "llama2_10b", "seq": 2048, "schedule": "sysx:cfg3", "replicas": 2},
            {"model": "llama2_10b", "seq": 2048, "schedule": "sysx:cfg3"},
        ]
    }
    cfg, _ = bench._cell_config(
        "llama2_10b", 2048, 8, "sysx:cfg3", {"steps": 2, "optimizer_workers": 1, "time_scale": 0.1, "warmup": 1}, 2
    )
    assert cfg.parallel.replicas == 2 and cfg.train.micro_batches == 8  # each replica: one node's 16 sequences
    rows = [_bench_row(4, 10.0), _bench_row(8, 11.0), _bench_row(8, 10.0, replicas=2)]
    assert "| 2x4 |" in bench.table(rows)
    (line,) = bench.replica_lines(rows).splitlines()
    assert "6554 tokens/s measured (1.10x one 8-rank pipeline, 2.00x R=1)" in line
