"""``device=emulated`` (sysx.emulate): emulated streams and events order work like CUDA's, the pacer
refuses a measurement whose real part is longer than modelled, and an emulated 2-rank job computes
exactly the losses of the same job on CPU (emulation changes time, never numbers).

No outcome here depends on the machine's speed: orderings and bookkeeping are checked on modelled
times (exact arithmetic), and the only real waits are long against what they are compared with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_runtime_procs import child_pythonpath

from sysx.config import EmulateSection, EvalSection, ModelSection, OptimSection, SysxConfig, TrainSection, validate
from sysx.emulate import (
    EmulatedEvent,
    EmulatedPacer,
    EmulatedPlan,
    EmulatedStream,
    emulated_model,
    merge_report,
    plan_emulation,
)
from sysx.runtime import PipelineOptions
from sysx.runtime.options import make_schedule
from sysx.schedule import Op, OpKind, Schedule

ROOT = Path(__file__).resolve().parents[1]


def _zero() -> float:
    return 0.0


# ------------------------------------------------------------------------------ streams and events
def test_a_copy_waits_for_the_event_it_waits_on() -> None:
    compute, h2d = EmulatedStream("compute", issue=_zero), EmulatedStream("h2d", issue=_zero)
    compute.charge(5.0)
    released = compute.record_event()
    assert released.timestamp() == compute.free
    h2d.wait_event(released)
    h2d.charge_next(2.0)
    with h2d.use():
        ready = EmulatedEvent().record()  # no stream named: the one the block issues on
    assert ready.timestamp() == released.timestamp() + 2.0
    compute.wait_event(ready)
    start, end = compute.charge(1.0)
    assert (start, end) == (ready.timestamp(), ready.timestamp() + 1.0)


def test_durations_add_up_on_one_stream_and_wait_stream_orders_after_another() -> None:
    s, other = EmulatedStream("d2h", issue=_zero), EmulatedStream("compute", issue=_zero)
    first, _ = s.charge(1.0)
    s.charge(2.0)
    _, last = s.charge(3.0)
    assert last - first == 6.0
    other.charge(100.0)
    s.wait_stream(other)
    start, _ = s.charge(0.5)
    assert start == other.free


def test_synchronize_sleeps_to_the_modelled_end() -> None:
    s = EmulatedStream("h2d")
    s.charge(1.0)
    event = s.record_event()
    assert not event.query()  # one second of work was just issued
    event.synchronize()
    assert time.monotonic() >= event.timestamp() and event.query()
    s.charge(0.2)
    s.synchronize()
    assert time.monotonic() >= s.free


def test_an_event_never_recorded_does_not_wait() -> None:
    s = EmulatedStream("compute", issue=_zero)
    event = EmulatedEvent()
    event.wait(s)
    assert s.after == 0.0 and event.query()
    event.synchronize()
    with pytest.raises(RuntimeError, match="never recorded"):
        event.timestamp()


def test_a_gradient_buffer_still_copying_out_is_not_reused() -> None:
    """The next sub-stage's backward gets a new buffer instead of waiting for the last offload."""
    import torch

    from sysx.runtime.buffers import GradBuffers

    compute, d2h = EmulatedStream("compute", issue=_zero), EmulatedStream("d2h", issue=_zero)
    grads = GradBuffers(torch.float32, torch.device("cpu"), compute=compute, d2h=d2h)
    first = grads.get((1, 0), 8)
    d2h.charge_next(1e6)  # an offload that ends long after this test
    grads.offload((1, 0), torch.empty(8))
    second = grads.get((0, 1), 8)
    assert second.data_ptr() != first.data_ptr() and compute.after == 0.0
    d2h.free = d2h.after = 0.0
    grads._pool = [(buf, EmulatedEvent().record(d2h)) for buf, _ in grads._pool]  # the copy is done now
    grads.offload((0, 1), torch.empty(8))
    assert grads.get((0, 0), 8).data_ptr() == first.data_ptr()


def test_messages_between_nodes_take_the_inter_node_link() -> None:
    from sysx.partition import uniform_partition
    from sysx.schedule import build
    from sysx.schedule.costs import Costs

    sched = build("gpipe", 4, 4, uniform_partition(4, 1), n_stages=4, split=1)
    costs = Costs(
        layer_fwd_time=(1.0,) * 4,
        layer_params=(1.0,) * 4,
        act_bytes=1e9,
        p2p_bandwidth=10e9,
        p2p_latency=0.0,
        inter_p2p_bandwidth=1e9,
        inter_p2p_latency=0.5,
        gpus_per_node=2,
    )
    tab = costs.table(sched)
    assert tab.act_xfer[:3] == [0.1, 1.5, 0.1]  # stage 1 on rank 1 sends to rank 2 on the other node
    assert tab.grad_xfer[2] == 1.5 and tab.grad_xfer[1] == tab.grad_xfer[3] == 0.1
    one_node = Costs(**{**costs.__dict__, "gpus_per_node": None}).table(sched)
    assert one_node.act_xfer[:3] == [0.1] * 3


def test_posted_sends_cost_the_sender_nothing_and_start_when_both_sides_posted() -> None:
    """The runtime's sends are isends: the plan's ``posted_sends`` (a blocking send would hold the sender)."""
    import dataclasses

    from sysx.partition import uniform_partition
    from sysx.schedule import build
    from sysx.schedule.costs import UnitCosts
    from sysx.schedule.simulate import simulate

    sched = build("gpipe", 2, 2, uniform_partition(2, 1), n_stages=2, split=1)
    tab = dataclasses.replace(UnitCosts().table(sched), act_xfer=[0.5, 0.5])

    def starts(table: object) -> dict[str, float]:
        return {f"{e.rank} {e.op}": e.start for e in simulate(sched, table).events}

    posted, eager = starts(dataclasses.replace(tab, posted_sends=True)), starts(tab)
    assert posted["0 F s0 mb1"] == 1.0 and eager["0 F s0 mb1"] == 1.5  # eager: the send holds rank 0 for 0.5
    assert posted["1 F s1 mb0"] == eager["1 F s1 mb0"] == 1.5  # rank 1 posted its receive at 0: arrival 1 + 0.5
    assert posted["0 SEND_ACT s0 mb0 ->r1"] == 1.0  # the transfer, on rank 0's p2p lane


# ----------------------------------------------------------------------------------------- pacer
def _pacer(time_scale: float) -> EmulatedPacer:
    plan, schedule = _plan(time_scale)
    return EmulatedPacer(plan, schedule, 0, time_scale=time_scale)


def _plan_cfg(time_scale: float = 1.0) -> SysxConfig:
    cfg = SysxConfig(
        model=ModelSection(preset="tiny"),
        device="emulated",
        eval=EvalSection(every=0),
        train=TrainSection(steps=3, micro_batch_size=1, micro_batches=2, seq_len=16),
        emulate=EmulateSection(model="llama2_7b", seq_len=2048, micro_batch_size=2, time_scale=time_scale),
    )
    validate(cfg)
    return cfg


def _plan(time_scale: float) -> tuple[EmulatedPlan, Schedule]:
    """The emulated 7B plan of a 2-rank SysX schedule and the schedule."""
    cfg = _plan_cfg(time_scale)
    opts = PipelineOptions(schedule="sysx", optim_backend="torch")
    model = emulated_model(cfg)
    schedule = make_schedule(opts, model.config, n_ranks=2, n_micro=2, seq_len=model.seq_len)
    return plan_emulation(cfg, schedule, backend="torch"), schedule


def test_the_plan_takes_the_device_lane_in() -> None:
    """``device_lane_plan``: no unit on the lane is the CPU lane's plan; units the placement model put
    there shorten the plan on an H100, which the lane's copies and steps then end."""
    import dataclasses

    from sysx.emulate.costs import device_lane_plan
    from sysx.runtime.lanes import emulated_placement, lane_times

    plan, schedule = _plan(1.0)
    assert device_lane_plan(plan, schedule, [{}, {}]) == (plan.timeline.iteration, plan.timeline.bubble_ratio)
    h100 = dataclasses.replace(
        plan,
        cluster=dataclasses.replace(plan.cluster, h2d_bandwidth=50e9, d2h_bandwidth=50e9, device_mem_bandwidth=2.8e12),
    )
    ranks = [emulated_placement("split", h100, schedule, r, speculative=True) for r in range(2)]
    assert any(p.device for p, _ in ranks)
    it, bubble = device_lane_plan(h100, schedule, lane_times(schedule, ranks))
    assert it < plan.timeline.iteration and bubble < plan.timeline.bubble_ratio
    slow = [{key: (10.0, 1.0, 10.0) for key in lane} for lane in lane_times(schedule, ranks)]  # a lane of 21 s a unit
    n = max(len(lane) for lane in slow)
    # the lane starts after the VALIDATE barrier (after every rank's passes): in 10 s each, out 10 s after the last step
    assert device_lane_plan(h100, schedule, slow)[0] >= max(plan.timeline.gpu_end) + 10.0 * n + 11.0


def test_the_plan_with_the_tier_fits_30b_on_a_256_gib_node() -> None:
    """``optim.offload=nvme`` on the emulated node: the states leave the host plan (30B on one 4-GPU
    node of 256 GiB fits with the tier, not without), and the disk lane lengthens a short step."""
    cfg = SysxConfig(
        model=ModelSection(preset="tiny"),
        device="emulated",
        precision="bf16",
        train=TrainSection(micro_batch_size=1, micro_batches=4, seq_len=16),
        optim=OptimSection(workers=1),  # a staging buffer per worker: one, as DeepSpeed's Adam runs
        emulate=EmulateSection(model="llama2_30b", seq_len=2048, micro_batch_size=1, host_memory_gib=256),
    )
    validate(cfg)
    model = emulated_model(cfg)
    opts = PipelineOptions(schedule="sysx", optim_backend="torch")
    schedule = make_schedule(opts, model.config, n_ranks=4, n_micro=4, seq_len=model.seq_len)
    host, tier = (plan_emulation(cfg, schedule, backend="torch", nvme=on) for on in (False, True))
    node = tier.cluster.host_memory_bytes
    assert sum(host.timeline.host) + host.timeline.shm[0] > node > sum(tier.timeline.host) + tier.timeline.shm[0]
    assert host.disk_timeline is None and host.iteration == host.timeline.iteration
    io = tier.disk_timeline
    assert io is not None and io.base == tier.timeline.iteration and tier.iteration == io.iteration > io.base


def test_the_pacer_charges_the_tier_on_one_disk_lane_and_a_step_waits_for_its_read() -> None:
    """``EmulatedPacer.disk_pace``: the tier's reads and writes, scaled to the emulated state bytes,
    take turns on the rank's share of the node's drives; an optimizer job that waited inside for a
    read starts (modelled) at the read's end, and its write-back, sent off by the real (small) step
    long before, starts at the job's modelled end."""
    import threading

    plan, schedule = _plan(1.0)
    cfg_plan = plan_emulation(_plan_cfg(), schedule, backend="torch", nvme=True)
    disk = cfg_plan.disk
    assert disk is not None and plan.disk is None
    owned = sum(disk.nbytes[s * schedule.partition.split + k] for s, k in schedule.assignment.bwd_substages(0))
    scale = 0.05 * disk.read_bandwidth * 10 / owned  # a tenth of the rank's state reads in 0.05 s on the wall
    pacer = EmulatedPacer(cfg_plan, schedule, 0, time_scale=scale)
    assert EmulatedPacer(plan, schedule, 0, time_scale=scale).disk_pace() is None
    pace = pacer.disk_pace()
    assert pace is not None
    pacer.calibrate_disk(1000)
    pacer.begin_step(0)
    reads = [threading.Thread(target=pace, args=("read", 100)) for _ in range(2)]
    name = next(iter(pacer._opt))
    write = threading.Thread(target=pace, args=("write", 100))
    with pacer._optimizer_span(name, None):
        for t in reads:
            t.start()
        for t in reads:
            t.join()
        write.start()  # the step's write-back, sent off with its real arithmetic
    write.join()
    spans = {(lane, op): (start, end) for lane, op, start, end in pacer._stats.spans}
    lane = [(s, e) for lane_, op, s, e in pacer._stats.spans if lane_ == "disk" and op in ("READ", "WRITE")]
    assert [round(e - s, 6) for s, e in lane] == [
        0.05,
        0.05,
        round(0.05 * disk.read_bandwidth / disk.write_bandwidth, 6),
    ]
    # one lane: the second read, issued while the first ran, starts at its end
    assert lane[1][0] == pytest.approx(lane[0][1])
    job = spans[("cpu", f"OPT {name}")]
    assert job[0] == pytest.approx(lane[1][1])  # the job started at the last read's end
    # its write-back at the job's modelled end: never before it, and on a busy machine its thread may
    # start a few ms late (3.6 ms once in CI); the job lasts ~70 ms, so 20 ms still tells end from start
    assert job[1] - 1e-3 <= lane[2][0] <= job[1] + 0.02


def _run_forwards(
    pacer: EmulatedPacer, real_s: float, *, validate_s: float | None = None, after_s: float = 0.0
) -> dict:
    """Three steps of two forwards whose real part takes ``real_s``; with ``validate_s``, a VALIDATE
    taking that long ends each step, and ``after_s`` of real work follows it. The run's report."""
    handlers = {kind: (lambda op: None) for kind in OpKind}
    handlers[OpKind.FORWARD] = lambda op: time.sleep(real_s)
    handlers[OpKind.VALIDATE] = lambda op: time.sleep(validate_s or 0.0)
    paced = pacer.wrap(handlers, lambda unit: None)
    for step in range(3):
        pacer.begin_step(step)
        t0 = time.monotonic()
        for mb in range(2):
            paced[OpKind.FORWARD](Op(OpKind.FORWARD, 0, mb=mb))
        if validate_s is not None:
            paced[OpKind.VALIDATE](Op(OpKind.VALIDATE, -1))
        time.sleep(after_s)
        pacer.end_step(time.monotonic() - t0)
    tl = pacer.plan.timeline
    return merge_report(
        [pacer.steps],
        time_scale=pacer.time_scale,
        warmup_steps=1,
        max_late=0.05,
        plan_iteration=tl.iteration,
        plan_bubble=tl.bubble_ratio,
    )


def test_a_real_part_longer_than_modelled_refuses_the_measurement() -> None:
    pacer = _pacer(time_scale=1e-6)  # a forward of stage 0 is modelled in microseconds; it really takes 20 ms
    report = _run_forwards(pacer, real_s=0.02)
    assert report["measured"] is None
    assert "real part of compute ops is longer than modelled" in report["refused"], report["refused"]
    assert report["real_ratio"]["compute"]["mean"] > 100 and report["real_ratio"]["compute"]["over_1"] == 4
    assert "F s0 mb" in report["refused"] and "raise emulate.time_scale" in report["refused"]


def test_a_real_part_within_the_model_is_measured() -> None:
    probe = _pacer(time_scale=1.0)
    scale = 0.1 / probe.table.fwd[0]  # a forward takes 0.1 s on the wall clock; its real part is nothing
    report = _run_forwards(_pacer(time_scale=scale), real_s=0.0)
    assert report["refused"] is None and report["steps_measured"] == 2
    assert report["real_ratio"]["compute"]["max"] < 0.5 and report["real_ratio"]["compute"]["ops"] == 4
    m = report["measured"]
    assert m["iteration_s"] >= 2 * probe.table.fwd[0]  # two modelled forwards per step at least
    assert m["bubble"] < 0.5  # the steps were mostly forwards


@pytest.mark.parametrize("where", ["validation", "after the barrier"])
def test_real_work_at_the_end_of_a_step_is_lag(where: str) -> None:
    """A slow all-reduce (in VALIDATE, or the loss all-reduce after it) has no modelled time: when it
    outlasts ``max_late`` of a step the measurement is refused, not reported as the cluster's."""
    probe = _pacer(time_scale=1.0)
    pacer = _pacer(time_scale=0.1 / probe.table.fwd[0])  # a modelled forward takes 0.1 s of wall time
    in_validation = where == "validation"
    report = _run_forwards(
        pacer, real_s=0.0, validate_s=0.1 if in_validation else 0.0, after_s=0.0 if in_validation else 0.1
    )
    assert report["measured"] is None and "lag its modelled timeline" in report["refused"], report
    assert ("VALIDATE" if where == "validation" else "end of step") in report["late_op"]


def test_a_recorded_window_is_reported_in_modelled_seconds_and_bytes() -> None:
    from sysx.trace.recorder import RankPart, Span

    pacer = _pacer(time_scale=0.5)
    load = Op(OpKind.LOAD_PARAMS, 1)
    part = RankPart(
        0,
        "host",
        {3: 10.0},
        [
            Span(0, 3, "h2d", "H2D s1", load, 10.0, 11.0, 4096),
            Span(0, 3, "compute", "F s1 mb0", Op(OpKind.FORWARD, 1, mb=0), 11.0, 12.0),
        ],
    )
    out = pacer.modelled(part)
    assert out.starts == {3: 20.0} and [(x.start, x.end) for x in out.spans] == [(20.0, 22.0), (22.0, 24.0)]
    # a stage of llama2_7b (one Block: 0.4 GB in bf16), not the tiny copy's
    assert out.spans[0].nbytes == int(pacer.table.param_stage[1]) > 10**8
    assert out.spans[1].nbytes == 0


# ------------------------------------------------------------------------------ the job, 2 ranks
def _launch(args: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SYSX_JOB_ID", "TORCHELASTIC_RUN_ID")}
    env.update(PYTHONPATH=child_pythonpath(env), OMP_NUM_THREADS="1")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sysx.launch",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "sysx.train",
            *args,
            f"run_dir={run_dir}",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


COMMON = [
    "schedule=sysx",
    "precision=fp32",
    "train.steps=3",
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "train.micro_batches=4",
    "eval.every=0",
    "log.every=1",
    "optim.backend=torch",
    "optim.grad_clip=0",
    "checkpoint.keep=1",
]


@pytest.mark.timeout(300)
def test_an_emulated_run_computes_the_losses_of_the_cpu_run(tmp_path: Path) -> None:
    from sysx.model import get_preset
    from sysx.partition import partition_model
    from sysx.runtime.options import block_stages

    emulated = _launch(
        [*COMMON, "device=emulated", "emulate.model=llama2_7b", "emulate.time_scale=0.02"], tmp_path / "emulated"
    )
    assert emulated.returncode == 0, emulated.stderr[-3000:]
    # the emulated run is cut like llama2_7b (32 blocks at seq 16) at the default layout (one block
    # per stage, d = 1: 33 stages); the CPU run gets the same cut
    cut = partition_model(get_preset("llama2_7b"), 16, block_stages(34), split=1)
    sizes = [len(cut.stage_layers(s)) for s in range(cut.n_stages)]
    cpu = _launch(
        [*COMMON, "device=cpu", "model.n_layers=32", f"schedule.stage_sizes=[{','.join(map(str, sizes))}]"],
        tmp_path / "cpu",
    )
    assert cpu.returncode == 0, cpu.stderr[-3000:]

    def numbers(run: str) -> list[tuple[float, float]]:
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [(r["loss"], r["grad_norm"]) for r in rows]

    assert len(numbers("cpu")) == 3 and numbers("emulated") == numbers("cpu")  # bit for bit
    report = json.loads((tmp_path / "emulated" / "summary.json").read_text())["emulation"]
    assert report["model"] == "llama2_7b" and report["plan"]["iteration_s"] > 0 and report["steps_measured"] == 2
    assert (report["measured"] is None) == (report["refused"] is not None)  # one or the other, said either way
    assert "emulation (time x0.02): plan" in emulated.stdout
    # optim.placement=auto: one line for both ranks (rank 0's), each rank's split in summary.json
    said = [line for line in emulated.stdout.splitlines() if "optimizer placement" in line]
    assert len(said) == 1 and "optimizer placement over 2 ranks: " in said[0], said
    placed = json.loads((tmp_path / "emulated" / "summary.json").read_text())["placement"]
    assert placed["mode"] == "auto" and len(placed["ranks"]) == 2 and all("saving_s" in r for r in placed["ranks"])
    assert "emulation" not in json.loads((tmp_path / "cpu" / "summary.json").read_text())
    # the closing line and the summary count seconds of one kind: modelled (wall / emulate.time_scale)
    summary = json.loads((tmp_path / "emulated" / "summary.json").read_text())
    assert summary["clock"] == "modelled" and summary["total_time_s"] >= summary["train_time_s"]
    assert summary["wall_time_s"] == pytest.approx(summary["total_time_s"] * 0.02)
    done = emulated.stdout.strip().splitlines()[-1]
    assert done.startswith("done: 3 steps") and " modelled (emulated: wall / emulate.time_scale 0.02" in done
    # TFLOP/s per emulated GPU: llama2_7b's FLOPs of the step's 128 tokens over the modelled time and 2 GPUs;
    # MFU against the emulated V100's 112 TFLOP/s peak (the CPU run has neither)
    from sysx.model.flops import flops_per_token

    step_flops = flops_per_token(get_preset("llama2_7b"), 16) * 4 * 2 * 16
    for row in [json.loads(x) for x in (tmp_path / "emulated" / "metrics.jsonl").read_text().splitlines()]:
        assert row["tflops"] == pytest.approx(step_flops / row["step_time_s"] / 2 / 1e12)
        assert row["mfu"] == pytest.approx(row["tflops"] / 112)
    assert "tflops" not in json.loads((tmp_path / "cpu" / "metrics.jsonl").read_text().splitlines()[0])


def test_steps_validated_first_are_predicted_with_the_costs_of_their_own_plan() -> None:
    """Validating first, every sub-stage steps after VALIDATE on all of a rank's Adam threads, so its
    plan has its own table (half the asynchronous workers' step time here). The prediction check and
    the plan beside a recorded timeline used the run's table for that program: on the emulated 10B
    they read 15.54 s against the emulation's own 12.84 s plan of the same steps (-21.5% warned)."""
    import functools

    from sysx.autotune.check import predict
    from sysx.config import resolve
    from sysx.emulate.costs import emulated_model
    from sysx.emulate.device_model import device_model
    from sysx.runtime.options import options_from_config
    from sysx.trainers.prediction import RunCosts

    cfg = resolve(
        SysxConfig(
            model=ModelSection(preset="tiny"),
            train=TrainSection(steps=4, micro_batch_size=1, micro_batches=8, seq_len=16),
            optim=OptimSection(backend="torch"),
            eval=EvalSection(every=0),
            device="emulated",
            emulate=EmulateSection(model="llama2_10b", seq_len=2048, micro_batch_size=2),
        )
    )
    build = functools.partial(make_schedule, options_from_config(cfg), n_ranks=4, n_micro=8)
    model = device_model(cfg, emulated_model(cfg).config, build, rank=0, group=None, world=1, backend="torch")
    model.validated_first.update({1, 2, 3})
    program = model.plan_schedule([1, 2, 3])
    assert program is not model.schedule
    costs = RunCosts(None, model.table_for, lookup=lambda: None, window=None)  # type: ignore[arg-type]
    table, source = costs.costs(program)
    assert source == "emulated device" and table is not None and table != model.table
    gpn = model.gpus_per_node(4)
    predicted = predict(program, table, memory="", source=source, gpus_per_node=gpn).iteration_s
    assert predicted == pytest.approx(model.planned([1, 2, 3])[0], rel=1e-9)
    assert costs.plan_table(program) is table and costs.plan_table(model.schedule) is model.table
