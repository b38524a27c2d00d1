"""Host costs the layer times leave out (issue 27, point 3): the simulator charges the executor's
per-instruction cost and the per-message latency, the host plan holds the fixed per-process bytes,
and the machine's figures are measured and cached with its hardware profile."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sysx.autotune.check import HOST, predict
from sysx.autotune.contention import cpu_ratio, mean_run_seconds
from sysx.autotune.costs import profiled_costs
from sysx.autotune.profile import MachineProfile
from sysx.machine import hardware_cache
from sysx.machine.hardware import HardwareProfile
from sysx.machine.host_cost import measure_op_host_s
from sysx.partition import uniform_partition
from sysx.schedule import UnitCosts, build_gpipe, simulate
from sysx.schedule.costs import HostLane, with_replicas
from sysx.schedule.replica_costs import ReplicaCosts
from sysx.schedule.simulate import host_bound
from sysx.single.hardware import assumed_hardware
from sysx.single.plan_costs import round_host_s
from sysx.trainers.prediction import release_free_heap
from tests.test_autotune import SEQ, TINY, synthetic_profile


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


def test_the_baseline_comes_after_the_optimizer_op_the_job_steps_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's package and op (21 MiB) load before the baseline of a job that steps with them
    (the default job read them as +11% host memory), not for optim.backend=torch; a failed load is
    left to the job's own, which says what failed (auto falls back there)."""
    from sysx.optim import deepspeed_backend
    from sysx.trainers.prediction import start_host_peak

    calls: list[str] = []

    def load_op() -> None:
        calls.append("load")
        if len(calls) == 2:
            raise deepspeed_backend.DeepSpeedUnavailable("no g++")

    monkeypatch.setattr(deepspeed_backend, "load_op", load_op)
    for backend in ("torch", "auto", "deepspeed", "auto"):
        start_host_peak(backend)
    assert calls == ["load"] * 3


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


def test_the_node_lane_bounds_the_step_by_every_ranks_cpu_work() -> None:
    """gpipe, 2 ranks, 1 micro-batch, F=1, B=2 (step 6): each rank computes 3. One core, compute
    costing its time, 0.5 per instruction: the node's work is 6 + 0.5 x every instruction; two
    copies of each rank (replicas on the node) double it; cores enough, or one rank per node, the
    timeline's 6 stands; no lane, no bound."""
    sched = build_gpipe(2, 1)
    table = UnitCosts(1.0, 2.0, 0.0).table(sched)
    n_ops = sum(len(ops) for ops in sched.ops)
    lane = HostLane(cores=1.0, compute_cpu=1.0, op_cpu=0.5)
    assert host_bound(sched, table, [3.0, 3.0], 2) == 0.0
    assert simulate(sched, dataclasses.replace(table, host_lane=lane), record=False).iteration == pytest.approx(
        6.0 + 0.5 * n_ops
    )
    twice = dataclasses.replace(table, host_lane=dataclasses.replace(lane, copies=2))
    assert simulate(sched, twice, record=False).iteration == pytest.approx(2 * (6.0 + 0.5 * n_ops))
    roomy = dataclasses.replace(table, host_lane=dataclasses.replace(lane, cores=100.0))
    assert simulate(sched, roomy, record=False).iteration == 6.0
    per_node = max(3.0 + 0.5 * len(ops) for ops in sched.ops)  # each rank alone on its node
    lone = dataclasses.replace(table, host_lane=lane)
    assert simulate(sched, lone, record=False, gpus_per_node=1).iteration == pytest.approx(max(6.0, per_node))
    # an optimizer step runs on opt_threads threads: each rank steps its one stage (t_opt=1) on 2
    opt = UnitCosts(1.0, 2.0, 1.0).table(sched)
    gpu = HostLane(cores=1.0, compute_cpu=0.0, opt_threads=2)  # compute on a GPU: only host work counts
    assert host_bound(sched, dataclasses.replace(opt, host_lane=gpu), [3.0, 3.0], 2) == pytest.approx(2 * 2 * 1.0)
    with pytest.raises(ValueError, match="cores"):
        HostLane(cores=0.0)


def test_replicas_sharing_a_node_multiply_the_lanes_work() -> None:
    sched = build_gpipe(2, 1)
    lane = HostLane(cores=2.0, compute_cpu=1.0)
    link = {"link_bandwidth": 1e9, "link_latency": 0.0, "memory_bandwidth": 1e9}
    shared = with_replicas(
        dataclasses.replace(UnitCosts().table(sched), host_lane=lane), ReplicaCosts(3, True, **link), sched
    )
    apart = with_replicas(
        dataclasses.replace(UnitCosts().table(sched), host_lane=lane), ReplicaCosts(3, False, **link), sched
    )
    assert shared.host_lane is not None and shared.host_lane.copies == 3
    assert apart.host_lane == lane  # each replica on its own node


def test_the_profiled_lane_charges_the_cpu_time_of_a_layer_on_a_cpu_and_none_on_a_gpu() -> None:
    """A CPU "device": a simulated second of compute (the profile's times x the slowdown) costs the
    node cpu_ratio / slowdown CPU seconds; a GPU's compute costs the host none; an assumed machine
    (the emulated device) gets no lane."""
    base = synthetic_profile()
    hw = dataclasses.replace(base.hardware, measured=True, op_host_s=7e-6)
    p = dataclasses.replace(base, hardware=hw, slowdown=2.5, cpu_ratio=1.25)
    lane = profiled_costs(p, TINY, SEQ, 2, gpus_per_node=4, threads_per_worker=3).host_lane
    assert lane == HostLane(cores=8.0, compute_cpu=0.5, op_cpu=7e-6, opt_threads=3)
    gpu = dataclasses.replace(p, hardware=dataclasses.replace(hw, kind="cuda"))
    assert profiled_costs(gpu, TINY, SEQ, 2).host_lane == HostLane(cores=8.0, compute_cpu=0.0, op_cpu=7e-6)
    assert profiled_costs(base, TINY, SEQ, 2).host_lane is None


def test_the_together_time_is_the_windows_mean_so_the_waits_for_other_ranks_count() -> None:
    """A run that waits one long slice in four (as a rank does sharing a core with three others)
    is 1/4 of its time slow: the median of the runs would say it never waits; the window's mean
    says 5 ms a run. The wait is no CPU time."""
    calls = [0]

    def step() -> None:
        calls[0] += 1
        if calls[0] % 4 == 0:
            time.sleep(0.02)

    wall, cpu = mean_run_seconds(step, repeats=8, window_s=0.0)
    assert calls[0] == 8 and wall >= 0.02 * 2 / 8 and cpu < 0.002
    calls[0] = 0
    mean_run_seconds(step, repeats=1, window_s=0.05)
    assert calls[0] > 1  # the window, not the repeats, ended it
    p = synthetic_profile()  # block: 1 ms forward + 3 ms backward at 64 tokens
    assert cpu_ratio(p, 64, [5e-3, 3e-3]) == pytest.approx(1.0)  # the profile's 4 ms Block: never below 1
    assert cpu_ratio(p, 64, [6e-3, 6e-3]) == pytest.approx(1.5)


def test_the_together_time_is_the_median_window_each_after_a_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    """One window disturbed (by a late rank, or by something else running) does not move the factor:
    the median of three is kept, and every window starts at a barrier so the ranks time it at once."""
    from sysx.autotune import contention
    from sysx.model import get_preset

    windows = iter([(1e-3, 1e-3), (9e-3, 8e-3), (2e-3, 3e-3)])
    monkeypatch.setattr(contention, "mean_run_seconds", lambda step, **kw: next(windows))
    barriers: list[int] = []
    got = contention.time_block_together(get_preset("tiny"), 8, torch.float32, barrier=lambda: barriers.append(1))
    assert (got.wall, got.cpu, got.rounds) == (2e-3, 3e-3, []) and len(barriers) == contention.WINDOWS == 3


def test_the_meeting_is_what_a_round_takes_beyond_the_ranks_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's end costs the waits for the slowest rank, the hand-offs and its collectives: per
    round the ranks' mean wall less their mean compute, the median round (one disturbed round does
    not move it); nothing for one rank. The rounds run as many Blocks on every rank: the slowest
    rank's window sets the count."""
    from sysx.autotune import contention
    from sysx.model import get_preset

    ranks = [[(0.10, 0.112), (0.10, 0.111), (0.10, 0.150)], [(0.11, 0.112), (0.11, 0.111), (0.10, 0.150)]]
    assert contention.meeting_seconds(ranks) == pytest.approx(0.112 - 0.105)
    assert contention.meeting_seconds(ranks[:1]) == 0.0 and contention.meeting_seconds([[], []]) == 0.0
    monkeypatch.setattr(contention, "mean_run_seconds", lambda step, **kw: (2e-3, 2e-3))
    met: list[float] = []

    def meet(value: float) -> float:  # this rank's value in, the ranks' maximum out (the other at 4 ms)
        met.append(value)
        return max(value, 4e-3)

    got = contention.time_block_together(get_preset("tiny"), 8, torch.float32, meet=meet, rounds=2, round_s=0.02)
    assert met[0] == 2e-3 and len(met) == 1 + 1 + 2 * 3  # the count's, the start's, a step end's three a round
    assert len(got.rounds) == 2 and all(wall >= own > 0 for own, wall in got.rounds)
    counts: list[int] = []
    real = contention.meeting_rounds
    monkeypatch.setattr(
        contention,
        "meeting_rounds",
        lambda step, *, per_round, **kw: (counts.append(per_round), real(step, per_round=per_round, **kw))[1],
    )
    contention.time_block_together(get_preset("tiny"), 8, torch.float32, meet=meet, rounds=1, round_s=0.02)
    assert counts == [5]  # 0.02 s at the slowest rank's 4 ms, not this rank's 2 ms


def test_a_meeting_round_ends_as_a_step_ends() -> None:
    """A round ends with a step end's three collectives (the replicas' reduction barrier, VALIDATE's
    all-reduce, the end's), each after a hand-off to the optimizer lane's thread, in that order;
    the round's wall runs until the last returned."""
    from sysx.autotune import contention

    events: list[str] = []

    def meet(value: float) -> float:
        events.append("meet")
        return value

    rounds = contention.meeting_rounds(
        lambda: events.append("block"), per_round=2, rounds=2, meet=meet, handoff=lambda: events.append("handoff")
    )
    end = ["handoff", "meet"] * contention.STEP_END_COLLECTIVES
    assert contention.STEP_END_COLLECTIVES == 3
    assert events == ["meet", "block", "block", *end, "block", "block", *end]
    assert len(rounds) == 2 and all(wall >= own for own, wall in rounds)


def test_a_cpu_profiles_measured_backward_bytes_replace_the_estimate() -> None:
    """A sub-stage of k Blocks holds once + k x per Block at its backward's peak: interpolated between
    the measured points around the micro-batch's tokens, outside them the nearest in proportion; the
    Embedding and Head keep the estimate; without a measurement the estimate stands. Kept through
    the profile's JSON."""
    base = synthetic_profile()
    p = dataclasses.replace(base, backward_bytes=[[32, 500, 200], [128, 3000, 600], [256, 5000, 1000]])
    assert p.backward_work(192) == pytest.approx((4000.0, 800.0))  # halfway from 128 to 256
    assert p.backward_work(512) == pytest.approx((10000.0, 2000.0))  # past 256: x2
    assert p.backward_work(16) == pytest.approx((250.0, 100.0))  # before 32: x1/2
    assert MachineProfile.from_json(p.to_json()).backward_bytes == p.backward_bytes
    plain = profiled_costs(base, TINY, SEQ, 2)
    costs = profiled_costs(p, TINY, SEQ, 2)
    assert 2 * SEQ == 128  # the micro-batch's tokens are a measured point
    assert costs.layer_act_bytes[1:-1] == (3000.0,) * TINY.n_layers and costs.bwd_once_bytes == 600.0
    assert (costs.layer_act_bytes[0], costs.layer_act_bytes[-1]) == (
        plain.layer_act_bytes[0],
        plain.layer_act_bytes[-1],
    )
    assert plain.bwd_once_bytes == 0.0 and base.backward_work(128) is None
    sched = build_gpipe(2, 1, uniform_partition(2, 1, 3))  # [Embedding, Block x2], [Block x2, Head]
    table = costs.table(sched)
    assert table.bwd_work[0] == pytest.approx(plain.layer_act_bytes[0] + 2 * 3000.0 + 600.0)


def _has_malloc_trim() -> bool:
    """Whether this C library is glibc (it has ``malloc_trim``), checked without calling it."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return name is not None and hasattr(ctypes.CDLL(name), "malloc_trim")
    except OSError:
        return False


@pytest.mark.skipif(not _has_malloc_trim(), reason="needs glibc's malloc_trim (musl and macOS have none)")
def test_the_heap_is_trimmed_before_a_ranks_baseline() -> None:
    """What the process freed (rank 0's profiling) leaves the resident heap before the baseline:
    16 MiB freed in the middle of the heap (a live block above it, so glibc cannot shrink the top on
    its own) go back to the kernel."""
    release_free_heap()  # what earlier tests freed: the 16 MiB below are then the trim's to find
    freed = [torch.ones(1 << 14) for _ in range(256)]  # 64 KiB each: heap chunks, under the mmap threshold
    above = torch.ones(1 << 14)
    freed[0].add_(above)
    del freed
    before = _anon()
    assert release_free_heap()
    assert _anon() <= before - 8 * 1024  # KiB: most of the 16 MiB


RANK_IMPORTS = r"""
import json, sys
from sysx.trainers.prediction import start_host_peak
from sysx.train import main
start_host_peak()
before = "torch.fx.experimental.symbolic_shapes" in sys.modules
status = main(["schedule=sysx", "train.steps=2", "train.seq_len=16", "train.micro_batch_size=2", "optim.backend=torch",
               "eval.every=0", "log.progress=false", "run_dir=" + sys.argv[1]])
print(json.dumps({"status": status, "before": before, "dynamo": "torch._dynamo" in sys.modules}))
"""


def test_a_pipeline_rank_has_torchs_backward_modules_before_its_baseline_and_never_imports_dynamo(
    tmp_path: Path,
) -> None:
    """The first backward with output gradients imports sympy (~30 MiB): before the baseline, so the
    check does not read it as the state's growth. torch._dynamo (0.9-1.0 s and 31-33 MiB a rank) is never
    imported by a pipeline rank's steps, so the baseline does not import it either."""
    done = subprocess.run(
        [sys.executable, "-c", RANK_IMPORTS, str(tmp_path / "run")], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"status": 0, "before": True, "dynamo": False}


def _anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_the_backward_probe_splits_its_peaks_and_says_when_it_failed(monkeypatch, caplog) -> None:
    """One Block's and four Blocks' peaks give ``(per Block, once)``: the difference over the three
    Blocks between them; a probe process that fails leaves the shape estimate in the plan, with one
    warning line naming why (never silently)."""
    import logging
    import subprocess

    from sysx.machine import host_cost

    assert host_cost.PROBE_BLOCKS == 4
    peaks = {1: {128: 30, 256: 50}, 2: {128: 40, 256: 70}, 4: {128: 60, 256: 110}}
    monkeypatch.setattr(host_cost, "_backward_peaks", lambda cfg, s, t, d, blocks, timeout: [peaks[b] for b in blocks])
    assert host_cost.measure_backward_bytes(None, 128, [256, 128], torch.float32) == {128: (10, 20), 256: (20, 30)}
    # the scatter of the larger peak is divided by the Blocks between: 3 MiB more at four Blocks is 1 a Block
    peaks[4] = {128: 60 + 3, 256: 110}
    assert host_cost.measure_backward_bytes(None, 128, [128], torch.float32) == {128: (11, 19)}
    assert host_cost.measure_backward_bytes(None, 128, [128], torch.float32, blocks=2) == {128: (10, 20)}

    def fails(*args, **kw):
        raise subprocess.CalledProcessError(1, "python", stderr="Traceback ...\nMemoryError: probe")

    monkeypatch.setattr(host_cost, "_backward_peaks", fails)
    with caplog.at_level(logging.WARNING, logger="sysx.machine"):
        assert host_cost.measure_backward_bytes(None, 128, [128], torch.float32) == {}
    assert "backward-memory probe failed (MemoryError: probe)" in caplog.text

    def slow(*args, **kw):
        raise subprocess.TimeoutExpired(["python", "-c", "the child script"], 120.0)

    monkeypatch.setattr(host_cost, "_backward_peaks", slow)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sysx.machine"):
        assert host_cost.measure_backward_bytes(None, 128, [128], torch.float32) == {}
    assert "backward-memory probe failed (no answer in 120 s)" in caplog.text and "child script" not in caplog.text


def test_the_optimizer_rates_are_timed_with_the_caches_cold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job meets its unit's state cold in training: each timed run follows an eviction, and both
    the Adam rate and the job rate are timed that way."""
    from sysx.machine import adam_rate

    log: list[str] = []
    monkeypatch.setattr(adam_rate, "evict_caches", lambda buffer: log.append(f"evict {buffer.numel()}"))
    seconds = adam_rate.fastest_cold(lambda: log.append("run"), 3, evict_bytes=1024)
    assert log == ["run", "evict 1024", "run", "evict 1024", "run", "evict 1024", "run"]  # warm-up, then 3 cold
    assert seconds >= 0.0

    timed: list[int] = []

    def fake(fn: object, repeat: int, **_: object) -> float:
        timed.append(repeat)
        return 1e-3

    monkeypatch.setattr(adam_rate, "fastest_cold", fake)
    assert adam_rate.adam_params_per_s(1000, backend="torch", repeat=2) == pytest.approx(1000 / 1e-3)
    assert adam_rate.optimizer_job_params_per_s(1000, backend="torch", repeat=4) == pytest.approx(1000 / 1e-3)
    assert timed == [2, 4]


def test_the_backward_probe_runs_more_blocks_than_a_small_model_has() -> None:
    """The probe's larger sub-stage is Blocks only, repeated when the model has fewer (fresh
    processes, both at once: their peaks are real, growing with the tokens and the Blocks)."""
    from sysx.machine import host_cost
    from sysx.model import ModelConfig

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    one, more = host_cost._backward_peaks(cfg, 16, [16, 256], torch.float32, (1, host_cost.PROBE_BLOCKS), 120.0)
    assert sorted(one) == sorted(more) == [16, 256]
    assert 0 <= one[16] <= one[256] and one[256] < more[256]


def test_the_backward_probe_runs_fewer_blocks_where_four_would_crowd_the_host() -> None:
    """Four Blocks against one where both processes fit a quarter of the host memory by the shape
    estimate; fewer, down to the old probe's two, for a large model on a small machine."""
    from sysx.autotune.profile import PROBE_SHARE, probe_blocks
    from sysx.model import get_preset
    from sysx.model.flops import block_matmul_params
    from sysx.schedule.costs import model_layer_act_bytes

    tiny = get_preset("tiny")
    big = dataclasses.replace(tiny, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000)
    per_block = 2 * 4 * (block_matmul_params(big) + 2 * big.dim) + 2 * model_layer_act_bytes(big, 4096, 4)[1]
    assert probe_blocks(tiny, 4096, 4, 2 * 2**30) == 4  # a laptop's 2 GiB free: tiny's probe as it is
    assert probe_blocks(big, 4096, 4, 5 * per_block / PROBE_SHARE) == 4
    assert probe_blocks(big, 4096, 4, 5 * per_block / PROBE_SHARE - 1) == 3
    assert probe_blocks(big, 4096, 4, 4 * per_block / PROBE_SHARE - 1) == 2
    assert probe_blocks(big, 4096, 4, 1.0) == 2  # never under two: one against one tells nothing


def test_the_backward_probe_takes_every_count_up_to_a_cap() -> None:
    from sysx.autotune.profile import BACKWARD_MAX_TOKENS, backward_probe_tokens

    assert backward_probe_tokens([256, 128, 2048, 512, 1024, 512]) == [128, 256, 512, 1024, 2048]
    assert backward_probe_tokens([2048, 4096, 8192, 32768]) == [2048, BACKWARD_MAX_TOKENS]
    assert backward_probe_tokens([8192, 16384]) == [8192]  # all past the cap: the fewest alone
    assert backward_probe_tokens([64]) == [64]
