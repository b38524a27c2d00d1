"""The timeline recorder (sysx/trace): a recorded window of a real 2-rank gloo job, the recorder's
cost when off, the sliding window's timeline, NVTX ranges from the config, profiling/nsys.sh,
profiled costs and measured numbers, and the ``profile.*`` keys.

The job tests run ``python -m sysx.train`` on 2 ranks the way torchrun starts them (sysx with async
checkpoints and optimizer, and mobius, validate-first) and read what rank 0 wrote:
``timeline.json`` (every op of each rank's list once per recorded step on the lane it belongs to,
no two boxes of one lane overlapping), ``timeline.png``, ``plan.png`` and the ``measured`` /
``plan`` sections of ``summary.json``.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_runtime_procs import launch

from sysx.config import (
    ConfigError,
    EvalSection,
    ModelSection,
    OptimSection,
    SysxConfig,
    TrainSection,
    load_config,
    model_config,
    validate,
)
from sysx.config.sections import ProfileSection
from sysx.runtime import PipelineOptions, make_schedule, options_from_config
from sysx.schedule import Op, OpKind, build_sysx, simulate
from sysx.schedule.costs import CostTable, UnitCosts
from sysx.trace import Span, op_lane, ranges
from sysx.trace.costs import measured_costs
from sysx.trace.recorder import RankPart, lane_family, worker_lane
from sysx.trace.replicas import replica_spread
from sysx.trace.summary import measured
from sysx.trace.timeline import merge, pack_lanes, step_timelines
from sysx.trainers.pipeline import PipelineTrainer
from sysx.trainers.single import SingleTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = [1, 2]
JOB = [
    "device=cpu",
    "train.steps=3",
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "train.micro_batches=2",
    "eval.every=0",
    "optim.backend=torch",
    "optim.workers=2",
    "log.progress=false",
    f"profile.timeline_steps=[{WINDOW[0]},{WINDOW[1]}]",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------- a 2-rank job
@pytest.fixture(scope="module", params=["sysx", "mobius"])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 2-rank job with a recorded window: its run_dir, rank 0's output and the ranks' op lists."""
    run_dir = tmp_path_factory.mktemp(f"trace_{request.param}")
    overrides = [f"schedule={request.param}", *JOB]
    procs = launch([sys.executable, "-m", "sysx.train", *overrides, f"run_dir={run_dir}"], 2, 2, timeout=120)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    cfg = load_config([*overrides, f"run_dir={run_dir}"])
    schedule = make_schedule(options_from_config(cfg), model_config(cfg), n_ranks=2, n_micro=2, seq_len=16)
    trace = json.loads((run_dir / "timeline.json").read_text())
    return {"run_dir": run_dir, "stdout": procs[0].stdout, "schedule": schedule, "trace": trace}


def boxes(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def lane_names(trace: dict) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


@pytest.mark.slow  # 2 processes
def test_the_job_writes_the_timeline_the_picture_and_the_plan(job: dict) -> None:
    run_dir = job["run_dir"]
    for name in ("timeline.png", "plan.png"):
        data = (run_dir / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    assert "timeline: steps 1-2 measured " in job["stdout"] and "plan (measured costs)" in job["stdout"]


@pytest.mark.slow  # 2 processes
def test_every_op_appears_once_per_recorded_step_on_its_lane(job: dict) -> None:
    trace, schedule = job["trace"], job["schedule"]
    lanes = lane_names(trace)
    for rank in range(2):
        expected = Counter((op_lane(op), op.kind.name, op.stage, op.sub, op.mb) for op in schedule.ops[rank])
        for step in WINDOW:
            seen: Counter = Counter()
            for e in boxes(trace):
                lane, a = lanes[(e["pid"], e["tid"])], e["args"]
                validation_job = lane.startswith("opt") and not a["is_async"]  # checks, undos, clipping: VALIDATE's
                if e["pid"] == rank and a["step"] == step and not validation_job:
                    seen[(lane_family(lane), a["kind"], a["stage"], a["sub"], a["mb"])] += 1
            assert seen == expected, f"rank {rank} step {step}: missing {expected - seen}, extra {seen - expected}"


def assert_well_formed(trace: dict) -> None:
    """Every box ends after it starts, after the window's start, and no two overlap on one lane."""
    found = boxes(trace)
    assert found and all(e["dur"] >= 0 and e["ts"] >= 0 for e in found)
    by_lane: dict[tuple[int, int], list[dict]] = {}
    for e in found:
        by_lane.setdefault((e["pid"], e["tid"]), []).append(e)
    for lane, events in by_lane.items():
        events.sort(key=lambda e: e["ts"])
        for a, b in zip(events, events[1:]):
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-3, f"lane {lane}: {a['name']} overlaps {b['name']}"


@pytest.mark.slow  # 2 processes
def test_boxes_are_well_formed_and_no_two_overlap_on_one_lane(job: dict) -> None:
    assert_well_formed(job["trace"])
    names = lane_names(job["trace"])
    assert {"compute", "h2d", "d2h", "p2p", "opt"} <= {lane_family(name) for name in names.values()}
    # optim.workers=2: each worker thread that ran a job of the window has its own lane. Which of
    # the pool's threads ran them is the scheduler's choice (on a busy machine one thread took every
    # job of the window once); two threads at once: test_each_optimizer_worker_records_on_its_own_lane
    opt_lanes = {name for (pid, _), name in names.items() if pid == 0 and lane_family(name) == "opt"}
    assert opt_lanes and opt_lanes <= {"opt0", "opt1"}


def test_each_optimizer_worker_records_on_its_own_lane() -> None:
    """Two jobs that can only finish together run on two threads of the optimizer's pool (named as
    :class:`~sysx.optim.threads.OptimizerThreads` names them), and each reports its own lane."""
    both = threading.Barrier(2, timeout=60)

    def job() -> str:
        both.wait()
        return worker_lane()

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="sysx-opt") as pool:
        lanes = [f.result(timeout=60) for f in [pool.submit(job), pool.submit(job)]]
    assert sorted(lanes) == ["opt0", "opt1"]


@pytest.mark.slow  # 2 processes
def test_the_chrome_trace_has_one_process_per_rank_and_one_thread_per_lane(job: dict) -> None:
    trace = job["trace"]
    processes = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert processes == {0: f"{job['schedule'].name} rank 0", 1: f"{job['schedule'].name} rank 1"}
    lanes = lane_names(trace)
    assert {(e["pid"], e["tid"]) for e in boxes(trace)} <= set(lanes)
    for rank in range(2):
        names = [lanes[(rank, t)] for t in sorted(t for p, t in lanes if p == rank)]
        assert names[0] == "compute" and len(set(names)) == len(names)
        assert [n for n in names if n.startswith("opt")] == sorted(n for n in names if n.startswith("opt"))


@pytest.mark.slow  # 2 processes
def test_the_summary_has_the_measured_and_planned_numbers(job: dict) -> None:
    summary = json.loads((job["run_dir"] / "summary.json").read_text())
    m, p = summary["measured"], summary["plan"]
    assert set(m) == {"iteration_s", "bubble", "optimizer_exposed_s", "h2d_gbps"} and set(p) == {
        "iteration_s",
        "bubble",
    }
    assert m["iteration_s"] > 0 and 0 <= m["bubble"] < 1 and 0 <= m["optimizer_exposed_s"] < m["iteration_s"]
    assert m["h2d_gbps"] > 0
    assert p["iteration_s"] > 0 and 0 <= p["bubble"] < 1
    # the plan runs the same ops with the window's own median costs: the same order of magnitude
    assert 0.2 < m["iteration_s"] / p["iteration_s"] < 5


# -------------------------------------------------------------------------- one process, in-process
def small_cfg(tmp_path: Path, **profile: object) -> SysxConfig:
    cfg = SysxConfig(
        model=ModelSection(preset="tiny"),
        train=TrainSection(steps=4, micro_batch_size=2, micro_batches=2, seq_len=16),
        optim=OptimSection(warmup_steps=2),
        eval=EvalSection(every=0, batches=2),
        device="cpu",
        run_dir=str(tmp_path / "run"),
        profile=ProfileSection(**profile),
    )  # type: ignore[arg-type]
    validate(cfg)
    return cfg


def parts(trainer: PipelineTrainer) -> list:
    return [trainer.executor, trainer.runtime.pool, trainer.runtime.grads, trainer.optimizer.threads]


def test_without_a_window_nothing_holds_a_recorder(tmp_path: Path) -> None:
    trainer = PipelineTrainer(small_cfg(tmp_path), PipelineOptions(schedule="sysx", optim_backend="torch"))
    try:
        assert trainer.window.recorder is None and all(p.recorder is None for p in parts(trainer))
        trainer.run(2)
    finally:
        trainer.close()
    assert set(trainer.measurements()) == {"host_memory"} and not (tmp_path / "run").exists()


def test_outside_its_window_the_recorder_records_nothing(tmp_path: Path) -> None:
    trainer = PipelineTrainer(
        small_cfg(tmp_path, timeline_steps=[2, 3]), PipelineOptions(schedule="sysx", optim_backend="torch")
    )
    try:
        rec = trainer.window.recorder
        assert rec is not None and all(p.recorder is rec for p in parts(trainer))
        trainer.run(2)
        assert rec.records == [] and not rec.on and rec.base is None
        trainer.train_step()
        assert rec.records and {r[0] for r in rec.records} == {2} and not rec.on
        trainer.evaluate()  # the evaluation program is no training step: not recorded
        assert {r[0] for r in rec.records} == {2}
        trainer.train_step()  # the window's last step: written, then forgotten
        assert rec.records == [] and set(trainer.measurements()) == {"measured", "plan", "prediction", "host_memory"}
    finally:
        trainer.close()
    assert {p.name for p in (tmp_path / "run").iterdir()} == {"timeline.json", "timeline.png", "plan.png"}


def test_nvtx_from_the_config_ranges_every_op_and_the_optimizer_jobs(
    tmp_path: Path, nvtx_ranges: list[tuple[str, str]]
) -> None:
    seen = nvtx_ranges
    trainer = PipelineTrainer(
        small_cfg(tmp_path, nvtx=True, timeline_steps=[0, 0]), PipelineOptions(schedule="sysx", optim_backend="torch")
    )
    try:
        assert ranges.enabled()
        trainer.train_step()  # recorded and ranged at once
    finally:
        trainer.close()
    assert Counter(n for n, t in seen if not t.startswith("sysx-opt")) == Counter(op.trace_name() for op in trainer.ops)
    workers = {n for n, t in seen if t.startswith("sysx-opt")}
    assert {f"OPT s{s}.{k}" for s in range(2) for k in range(2)} <= workers


def test_nsys_steps_on_cpu_says_once_that_it_applies_on_cuda_only(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    trainer = PipelineTrainer(
        small_cfg(tmp_path, nsys_steps=[1, 2]), PipelineOptions(schedule="sysx", optim_backend="torch")
    )
    try:
        trainer.run(3)
    finally:
        trainer.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "profile.nsys_steps" in line]
    assert len(lines) == 1 and "only applies on CUDA" in lines[0]
    assert trainer.window.nsys is None


def recorded_window(
    tmp_path: Path, *, window: int, steps: int, micro_batches: int, timeline: list[int]
) -> SingleTrainer:
    """A tiny ``schedule=single`` trainer of ``window`` blocks on rounds of 4 sequences, recording ``timeline``."""
    from sysx.config import SingleSection
    from sysx.single.hardware import assumed_hardware

    cfg = small_cfg(tmp_path, timeline_steps=timeline)
    cfg.train = TrainSection(steps=steps, micro_batch_size=2, micro_batches=micro_batches, seq_len=16)
    return SingleTrainer(
        cfg,
        single=SingleSection(window=window, round_sequences=4, micro_batch_size=2, print_plan=False),
        hardware=assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=8),
        optimizer_backend="torch",
    )


def test_the_sliding_window_records_its_passes_and_copies(tmp_path: Path) -> None:
    """schedule=single: 2 rounds of 2 chunks, a window of 1 block, so activations and gradients go
    home and come back; every pass and copy is a box on its lane, compared with the planner."""
    trainer = recorded_window(tmp_path, window=1, steps=2, micro_batches=4, timeline=[1, 1])
    try:
        trainer.run(2)
    finally:
        trainer.close()
    assert trainer.plan.rounds == 2 and trainer.plan.chunks == 2 and trainer.plan.window == 1
    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} == {"timeline.json", "timeline.png"}
    assert (
        set(trainer.measurements()["plan"]) == {"iteration_s"} and 0 <= trainer.measurements()["measured"]["bubble"] < 1
    )
    trace = json.loads((run / "timeline.json").read_text())
    assert_well_formed(trace)
    lanes = lane_names(trace)
    seen = Counter((lanes[(e["pid"], e["tid"])], e["name"]) for e in boxes(trace))
    # a backward pass is framed, not just marked: it lasts (well over 20 us even for this tiny model)
    assert min(e["dur"] for e in boxes(trace) if e["name"].startswith("B ")) > 20
    L = trainer.model_cfg.n_layers
    for k in range(1, L + 1):
        for c in range(2):
            assert seen[("compute", f"F s{k} mb{c}")] == 2 and seen[("compute", f"B s{k}.0 mb{c}")] == 2, (k, c)
            if k < L:  # the last block is the window: its activations stay on the device
                assert seen[("d2h", f"D2H act s{k} mb{c}")] == 2 and seen[("h2d", f"H2D act s{k} mb{c}")] >= 1
        assert seen[("d2h", f"D2H s{k}.0")] == 2 and seen[("h2d", f"H2D grads s{k}")] == 1
    assert seen[("h2d", "H2D s0")] == 1 and any(lane.startswith("opt") for lane, _ in seen)


def test_the_device_lane_s_steps_are_boxes_on_the_device_row(tmp_path: Path) -> None:
    """optim.placement's device lane steps on the trainer's thread after the decision: each step is a
    box on the compute row, so the recorded iteration holds it (first seen on an H200, where the
    window's timeline ended 0.10 s before its 0.26 s steps did and the prediction check compared
    the plan with the shorter figure)."""
    from sysx.optim.device_lane import DeviceLane

    trainer = recorded_window(tmp_path, window=2, steps=3, micro_batches=2, timeline=[1, 2])
    try:
        placed = [g.name for g in trainer.host.groups[:2]]
        trainer.use_device_lane(placed, DeviceLane("cpu"))
        trainer.run(3)
    finally:
        trainer.close()
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())
    assert_well_formed(trace)
    lanes = lane_names(trace)
    seen = Counter((lanes[(e["pid"], e["tid"])], e["name"]) for e in boxes(trace))
    assert {name: seen[("compute", f"OPT device {name}")] for name in placed} == dict.fromkeys(placed, 2)


# --------------------------------------------------------------------------------- profiled costs
def op(kind: OpKind, stage: int = -1, sub: int = -1, mb: int = -1, peer: int = -1, is_async: bool = False) -> Op:
    return Op(kind, stage, sub, mb, peer, is_async)


def test_measured_costs_takes_medians_and_pairs_both_sides_of_a_message() -> None:
    schedule = build_sysx(2, 2, n_stages=2, split=1)
    F, B = OpKind.FORWARD, OpKind.BACKWARD
    spans = [Span(0, 0, "compute", "F", op(F, 0, -1, j), 0.0, d) for j, d in enumerate([1.0, 5.0, 2.0])]
    spans += [Span(1, 0, "compute", "F", op(F, 1, -1, 0), 0.0, 5.0)]
    spans += [Span(r, 0, "compute", "B", op(B, s, 0, 0), 10.0, 10.0 + 2 * s + 1) for r, s in ((1, 0), (0, 1))]
    spans += [
        Span(0, 0, "h2d", "H2D s0", op(OpKind.LOAD_PARAMS, 0), 0.0, 0.5, 1000),
        Span(0, 0, "opt1", "OPT s1.0", op(OpKind.OPTIM_STEP, 1, 0, is_async=True), 20.0, 24.0),
        Span(0, 0, "opt0", "OPT clip s1.0", op(OpKind.OPTIM_STEP, 1, 0), 24.0, 30.0),
    ]
    # act s0 mb0: the receiver posted at 1, the sender at 2; the receiver saw it done at 3, the sender at 3.5
    spans += [
        Span(0, 0, "p2p", "SEND act s0 mb0", op(OpKind.SEND_ACT, 0, -1, 0, peer=1), 2.0, 3.5, 64),
        Span(1, 0, "p2p1", "RECV act s0 mb0", op(OpKind.RECV_ACT, 0, -1, 0, peer=0), 1.0, 3.0, 64),
    ]
    tab = measured_costs(spans, schedule, param_bytes=4.0)
    assert isinstance(tab, CostTable) and tab.unit == "s" and tab.rendezvous
    assert tab.fwd == [2.0, 5.0] and tab.bwd == [1.0, 3.0]
    assert tab.load_stage == [0.5, 0.0] and tab.param_stage == [1000.0, 0.0] and tab.params_stage[0] == 250.0
    assert tab.opt == [0.0, 4.0]  # the clip job is validation, not the step
    assert tab.act_xfer == [1.0, 0.0] and tab.optim_workers == 2
    with pytest.raises(ValueError, match="no recorded span of F s1"):
        measured_costs([s for s in spans if s.op is None or s.op.stage != 1], schedule)


def spans_of(schedule, costs: CostTable, steps: int) -> list[Span]:
    """A simulated run as a recorder would see it: the simulator's lanes renamed, ``steps`` steps in a
    row, its overlapping optimizer steps on as many worker lanes as they need."""
    tl = simulate(schedule, costs)
    names = {"gpu": "compute", "cpu": "opt", "h2d": "h2d", "d2h": "d2h", "p2p": "p2p"}
    out = []
    for step in range(steps):
        t0 = step * tl.iteration
        for ev in tl.events:
            lane = "compute" if ev.lane == "cpu" and not ev.op.is_async else names[ev.lane]
            out.append(Span(ev.rank, step, lane, ev.op.trace_name(), ev.op, t0 + ev.start, t0 + ev.end))
    return pack_lanes(out, "opt")


def test_the_plan_from_profiled_costs_of_a_simulated_run_is_that_run() -> None:
    schedule = build_sysx(2, 4, n_stages=4, split=2)
    costs = UnitCosts(1.0, 2.0, 3.0).table(schedule)
    costs.load_stage = [0.25] * 4
    costs.load_sub = [0.125] * 8
    spans = spans_of(schedule, costs, steps=2)
    tab = measured_costs(spans, schedule, rendezvous=False)
    for key in ("fwd", "bwd", "opt", "load_stage", "load_sub"):
        assert getattr(tab, key) == pytest.approx(getattr(costs, key)), key
    assert simulate(schedule, tab).iteration == pytest.approx(simulate(schedule, costs).iteration)
    merged = merge([RankPart(r, "h", {0: 0.0}, [s for s in spans if s.rank == r]) for r in range(2)])
    drawn = step_timelines(merged, n_ranks=2, name="sysx", schedule=schedule)
    assert [t.iteration for t in drawn] == pytest.approx([simulate(schedule, costs).iteration] * 2)
    assert drawn[0].bubble_ratio == pytest.approx(simulate(schedule, costs).bubble_ratio)


def test_the_measured_numbers_of_a_simulated_run_are_the_simulator_s() -> None:
    schedule = build_sysx(2, 4, n_stages=4, split=2)
    costs = UnitCosts(1.0, 2.0, 6.0).table(schedule)  # an optimizer long enough to stick out of the step
    costs.load_stage = [0.25] * 4
    tl = simulate(schedule, costs)
    spans = [s._replace(nbytes=1000) if s.lane == "h2d" else s for s in spans_of(schedule, costs, steps=3)]
    # VALIDATE on the compute lane from the rank's last pass to the end of the step: no pass, no busy time
    spans += [
        Span(
            r,
            step,
            "compute",
            "VALIDATE",
            op(OpKind.VALIDATE),
            step * tl.iteration + tl.gpu_end[r],
            (step + 1) * tl.iteration,
        )
        for r in range(2)
        for step in range(3)
    ]
    numbers = measured(spans, 2)
    assert numbers["iteration_s"] == pytest.approx(tl.iteration) and numbers["bubble"] == pytest.approx(tl.bubble_ratio)
    assert (
        numbers["optimizer_exposed_s"] == pytest.approx(tl.iteration - max(tl.gpu_end))
        and numbers["optimizer_exposed_s"] > 0
    )
    loads = [s for s in spans if s.lane == "h2d"]
    assert numbers["h2d_gbps"] == pytest.approx(1000 * len(loads) / sum(s.end - s.start for s in loads) / 1e9)


def test_overlapping_transfers_get_their_own_lanes() -> None:
    send = op(OpKind.SEND_CKPT, 0, 0, 0, peer=1, is_async=True)
    spans = [
        Span(0, 0, "p2p", "a", send, 0.0, 5.0),
        Span(0, 0, "p2p", "b", send, 1.0, 2.0),
        Span(0, 0, "p2p", "c", send, 2.0, 3.0),
        Span(1, 0, "p2p", "d", send, 1.0, 2.0),
    ]
    lanes = {s.name: s.lane for s in pack_lanes(spans, "p2p")}
    assert lanes == {"a": "p2p", "b": "p2p1", "c": "p2p1", "d": "p2p"}


def test_ranks_on_other_hosts_are_aligned_at_their_first_step() -> None:
    f = op(OpKind.FORWARD, 0, -1, 0)
    a = RankPart(0, "h0", {1: 100.0}, [Span(0, 1, "compute", "F", f, 100.5, 101.0)])
    b = RankPart(1, "h1", {1: 7.0}, [Span(1, 1, "compute", "F", f, 7.25, 8.0)])
    assert [(s.start, s.end) for s in merge([a, b])] == [(0.5, 1.0), (0.25, 1.0)]
    b_same_host = RankPart(1, "h0", {1: 100.2}, [Span(1, 1, "compute", "F", f, 100.25, 101.0)])
    merged = merge([a, b_same_host])  # one clock: rank 1 started its step 0.2 s later
    assert [s.start for s in merged] == pytest.approx([0.5, 0.25]) and [s.end for s in merged] == pytest.approx(
        [1.0, 1.0]
    )


def test_the_replicas_spread_is_when_the_last_replica_s_passes_end_after_the_first_s() -> None:
    """2 replicas of 2 ranks on one host: per step, the latest pass end of each replica's ranks;
    VALIDATE (the meeting itself) is not a pass. On two hosts there is no common clock."""
    f, b, v = op(OpKind.FORWARD, 0, -1, 0), op(OpKind.BACKWARD, 0, 0, 0), op(OpKind.VALIDATE, -1, -1, -1)

    def part(rank: int, host: str, ends: dict[int, float]) -> RankPart:
        spans = []
        for step, end in ends.items():
            spans += [
                Span(rank, step, "compute", "F", f, step, step + 0.1),
                Span(rank, step, "compute", "B", b, step + 0.1, end),
                Span(rank, step, "compute", "V", v, end, step + 0.9),
            ]
        return RankPart(rank, host, {step: float(step) for step in ends}, spans)

    ends = [{1: 1.30, 2: 2.52}, {1: 1.31, 2: 2.50}, {1: 1.34, 2: 2.40}, {1: 1.20, 2: 2.45}]  # per rank
    spread = replica_spread([part(r, "h0", e) for r, e in enumerate(ends)], ranks_per_replica=2)
    assert spread is not None and spread.steps == [1, 2] and spread.last == [1, 0]
    assert spread.spreads == pytest.approx([0.03, 0.07])
    assert spread.summary() == pytest.approx({"replica_spread_s": 0.05, "replica_spread_max_s": 0.07})
    assert "50.0 ms after the first (median of 2 steps, max 70.0 ms)" in spread.line()
    assert replica_spread([part(r, "h0", e) for r, e in enumerate(ends[:2])], ranks_per_replica=2) is None
    assert replica_spread([part(r, f"h{r // 2}", e) for r, e in enumerate(ends)], ranks_per_replica=2) is None


# ----------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "key,value,message",
    [
        ("timeline_steps", [2, 1], "0 <= first <= last"),
        ("timeline_steps", [-1, 1], "0 <= first <= last"),
        ("nsys_steps", [1, 2, 3], "[first,last]"),
    ],
)
def test_a_bad_window_names_the_key_and_the_fix(key: str, value: list[int], message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^profile\.{key}=\[.*\] is not valid: .*") as info:
        ProfileSection(**{key: value}).validate()
    assert message in str(info.value) and "e.g. [3,5]" in str(info.value) and "\n" not in str(info.value)


def test_a_window_past_the_last_step_is_refused() -> None:
    ProfileSection(timeline_steps=[0, 0], nsys_steps=[3, 3], nvtx=True).validate()
    with pytest.raises(ConfigError, match=r"profile\.nsys_steps=\[2, 4\] .* steps are 0\.\.3 .* raise train\.steps"):
        load_config(["train.steps=4", "profile.nsys_steps=[2,4]"])
    assert load_config(["train.steps=4", "profile.timeline_steps=[3,3]"]).profile.timeline_steps == [3, 3]


# ---------------------------------------------------------------------------------- nsys wrapper
FAKE_NSYS = """#!/usr/bin/env bash
# a stand-in for nsys: note how it was called (per rank), drop its options, run the command
echo "$@" > "$FAKE_NSYS_LOG.$RANK"
shift
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""


@pytest.mark.slow  # 2 processes
def test_nsys_sh_runs_every_rank_under_its_own_report(tmp_path: Path) -> None:
    """profiling/nsys.sh under a stand-in nsys (none here): each rank of the torchrun job runs as
    ``nsys profile --output=<dir>/sysx_%q{RANK} --capture-range=cudaProfilerApi ... python -m sysx.train``
    with NVTX on and the capture window passed; on CPU the job says once that the window is CUDA's."""
    import os
    import subprocess

    from test_runtime_procs import ROOT

    fake = tmp_path / "nsys"
    fake.write_text(FAKE_NSYS)
    fake.chmod(0o755)
    out, log = tmp_path / "reports", tmp_path / "called"
    env = {
        **os.environ,
        "NSYS": str(fake),
        "FAKE_NSYS_LOG": str(log),
        "NPROC": "2",
        "STEPS": "1,2",
        "OUT": str(out),
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("RANK", None)
    done = subprocess.run(
        ["bash", str(ROOT / "profiling" / "nsys.sh"), "schedule=sysx", *JOB[:-1], f"run_dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in range(2):
        called = (tmp_path / f"called.{rank}").read_text().split()
        assert called[:2] == ["profile", f"--output={out}/sysx_%q{{RANK}}"]
        assert {"--capture-range=cudaProfilerApi", "--capture-range-end=stop", "--trace=cuda,nvtx,osrt"} <= set(called)
        job = called[called.index("-m") :]
        assert job[:2] == ["-m", "sysx.train"] and {"profile.nvtx=true", "profile.nsys_steps=[1,2]"} <= set(job)
    assert done.stdout.count("profile.nsys_steps=[1, 2] only applies on CUDA") == 1
    assert f"reports in {out}/" in done.stdout


def test_a_measured_send_is_drawn_as_a_mark_at_its_post() -> None:
    """An isend's span ends when its sender waits, possibly long after the transfer: the picture
    shows its post, not a bar across the step."""
    f = op(OpKind.FORWARD, 0, -1, 0)
    send = op(OpKind.SEND_CKPT, 0, 0, 0, peer=1, is_async=True)
    spans = [Span(0, 0, "compute", "F", f, 0.0, 10.0), Span(0, 0, "p2p", "c", send, 1.0, 9.0)]
    (tl,) = step_timelines(spans, n_ranks=1, name="sysx")
    (mark,) = [e for e in tl.events if e.lane == "p2p"]
    assert mark.start == 1.0 and mark.end - mark.start <= 0.002 * 10.0 + 1e-12
