"""schedule.tune in a job: the prediction a run checks after its first steps (summary.json and the
log), rank 0's choice broadcast to every rank, the emulated device's profile, p2p figures in the
costs. The 2-rank run is spawned like tests/test_emulate.py spawns its jobs; nothing here depends
on this machine's speed: the run's profile is planted in the cache, 1000x too slow, so the
prediction is certainly off and the warning certainly printed."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_runtime_procs import child_pythonpath

from sysx.autotune import apply as apply_mod
from sysx.autotune import cache as cache_mod
from sysx.autotune import profile as prof
from sysx.autotune.check import WARN_PCT, Prediction, compare
from sysx.autotune.contention import Together
from sysx.autotune.costs import profiled_costs
from sysx.autotune.emulated import emulated_profile
from sysx.autotune.p2p import P2PFigures, fit_line
from sysx.autotune.profile import LayerTiming
from sysx.autotune.search import Job, candidate_costs, search
from sysx.config import load_config
from sysx.dist import DistInfo
from sysx.emulate import plan_emulation
from sysx.machine import hardware_cache
from sysx.machine.hardware_cache import machine_key
from sysx.model import get_preset
from sysx.optim.cores import rank_cores
from sysx.runtime.options import make_schedule, options_from_config
from sysx.schedule.simulate import simulate
from tests.test_autotune import ROOMY, synthetic_profile

ROOT = Path(__file__).resolve().parents[1]
TINY = get_preset("tiny")


def test_compare_reports_error_pct_and_warns_past_the_threshold() -> None:
    pred = Prediction(iteration_s=2.0, peak_bytes=100.0, memory="peak_host_bytes", source="tuned profile")
    section, lines = compare(pred, 2.1, 105.0, steps=[1, 2, 3], measured_by="step times")
    assert section["iteration_s"]["error_pct"] == pytest.approx(5.0) and section["peak_host_bytes"]["measured"] == 105.0
    assert len(lines) == 1 and "+5.0%" in lines[0]
    section, lines = compare(pred, 2.0, 100.0 * (1 + 1.01 * WARN_PCT / 100), steps=[1], measured_by="timeline")
    assert len(lines) == 2 and lines[1].startswith("warning:") and "peak_host_bytes" in lines[1]
    assert "iteration_s" not in lines[1].split("(")[1]


def test_p2p_line_fit_and_costs_take_the_profile_links() -> None:
    bw, lat = fit_line([1e3, 1e6, 4e6], [20e-6 + x / 2e9 for x in (1e3, 1e6, 4e6)])
    assert bw == pytest.approx(2e9) and lat == pytest.approx(20e-6)
    p = dataclasses.replace(synthetic_profile(), p2p=P2PFigures(4, 2, 3e9, 30e-6, 1e9, 80e-6))
    assert prof.MachineProfile.from_json(p.to_json()) == p
    costs = profiled_costs(p, TINY, 64, 2, gpus_per_node=2)
    assert (costs.p2p_bandwidth, costs.p2p_latency, costs.inter_p2p_bandwidth, costs.inter_p2p_latency) == (
        3e9,
        30e-6,
        1e9,
        80e-6,
    )
    assert costs.gpus_per_node == 2 and costs.posted_sends  # the runtime's isends


def _emulated_cfg(*extra: str):
    return load_config(
        [
            "device=emulated",
            "schedule=sysx",
            "schedule.tune=true",
            "emulate.model=llama2_7b",
            "emulate.seq_len=1024",
            "emulate.micro_batch_size=2",
            "train.seq_len=16",
            "train.micro_batch_size=1",
            "train.micro_batches=8",
            "optim.backend=torch",
            "precision=bf16",
            *extra,
        ]
    )


def test_the_emulated_device_answers_with_its_own_costs(monkeypatch) -> None:
    """Nothing is measured; the tuned costs of a configuration are the emulated device's own."""
    monkeypatch.setattr(prof, "measure_profile", lambda *a, **k: pytest.fail("the emulated device measured the CPU"))
    cfg = _emulated_cfg()
    job = apply_mod.job_from_config(cfg, 4, None, torch.device("cpu"))
    assert job.model == get_preset("llama2_7b") and job.global_batch == 16  # 2 (emulated) x 8 micro-batches
    assert job.ranks_per_node == 4 and job.seq_len == 1024 and job.work_dtype == "bfloat16"
    profile = emulated_profile(cfg, [1, 2, 4])
    assert profile.hardware.device_free_bytes == 32 * 2**30  # the emulated V100's memory is the GPU budget
    sched = make_schedule(options_from_config(cfg), job.model, n_ranks=4, n_micro=8, seq_len=1024)
    plan = plan_emulation(cfg, sched, backend="torch")
    workers = plan.optimizer_workers
    tuned = candidate_costs(job, profile, 2, workers, profile.cpu_threads // 4 // workers)
    a, b = simulate(sched, tuned.table(sched), gpus_per_node=4), plan.timeline
    assert a.iteration == pytest.approx(b.iteration, rel=1e-9) and a.peak_gpu == pytest.approx(b.peak_gpu)


def test_an_emulated_tuning_sets_the_emulated_micro_batch_and_keeps_the_batch(monkeypatch) -> None:
    monkeypatch.setattr(prof, "measure_profile", lambda *a, **k: pytest.fail("the emulated device measured the CPU"))
    tuned = apply_mod.tune_job(_emulated_cfg(), DistInfo(world_size=1), torch.device("cpu"))
    e, t = tuned.cfg.emulate, tuned.cfg.train
    assert e.micro_batch_size * t.micro_batches == 16 and t.micro_batch_size == 1 and tuned.costs is not None


def test_rank_1_takes_rank_0s_choice_without_searching(monkeypatch, tmp_path) -> None:
    """schedule.tune on a rank other than 0: no profile, no search; the broadcast decides."""
    monkeypatch.setenv("SYSX_CACHE_DIR", str(tmp_path))
    best = search(Job(TINY, 64, 8, 2, work_dtype="float32"), ROOMY, synthetic_profile()).best
    assert best is not None
    sent = [False, apply_mod.choice(best)]  # what rank 0 broadcasts: no p2p wanted, then its choice
    calls: list[int] = []

    def broadcast(box, src, group):
        assert src == 0
        calls.append(len(calls))
        box[0] = sent[len(calls) - 1]

    monkeypatch.setattr(apply_mod.tdist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(apply_mod.sdist, "cpu_group", lambda: None)
    # every rank times the Block together and gathers the times (rank 1 takes part, then only listens)
    gathered: list[tuple[float, float, list[tuple[float, float]]]] = []
    monkeypatch.setattr(apply_mod, "time_block_together", lambda *a, **k: Together(0.25, 0.2, [(0.1, 0.11)]))

    def all_gather(out, mine, group):
        gathered.append(mine)
        out[:] = [(0.5, 0.4, [(0.1, 0.11)]), mine]

    monkeypatch.setattr(apply_mod.tdist, "all_gather_object", all_gather)
    monkeypatch.setattr(apply_mod, "search", lambda *a, **k: pytest.fail("rank 1 searched"))
    monkeypatch.setattr(prof, "measure_profile", lambda *a, **k: pytest.fail("rank 1 profiled"))
    cfg = load_config(
        [
            "schedule=sysx",
            "schedule.tune=true",
            "model=tiny",
            "train.seq_len=64",
            "train.micro_batch_size=8",
            "train.micro_batches=1",
            "device=cpu",
        ]
    )
    tuned = apply_mod.tune_job(cfg, DistInfo(rank=1, world_size=2, local_world_size=2), torch.device("cpu"))
    assert len(calls) == 2 and tuned.costs is None and gathered == [(0.25, 0.2, [(0.1, 0.11)])]
    assert (tuned.cfg.schedule.stages_per_rank, tuned.cfg.schedule.split, tuned.cfg.train.micro_batch_size) == (
        best.options.stages_per_rank,
        best.options.split,
        best.micro_batch_size,
    )


# ------------------------------------------------------------------------------ the job, 2 ranks
SEQ = 32
JOB = [
    "schedule=auto",
    "schedule.tune=true",
    "parallel.replicas=1",  # the prediction of one 2-rank pipeline (null: the tuner may choose replicas)
    "model=tiny",
    "precision=fp32",
    "train.steps=4",
    f"train.seq_len={SEQ}",
    "train.micro_batch_size=2",
    "train.micro_batches=4",
    "eval.every=0",
    "log.every=1",
    "log.progress=false",
    "optim.backend=torch",
    "checkpoint.keep=1",
    "device=cpu",
]


def _slow_profile(cache: Path) -> None:
    """Plant this machine's profile of the job's shape for its 2 ranks' threads, every layer 1000x
    slower than any CPU runs it."""
    profile = synthetic_profile(TINY, SEQ, sizes=(1, 2, 4, 8))
    layers = {k: [LayerTiming(p.tokens, p.fwd_s * 1000, p.bwd_s * 1000) for p in v] for k, v in profile.layers.items()}
    profile = dataclasses.replace(
        profile,
        layers=layers,
        machine=machine_key(torch.device("cpu")),
        shape=prof.shape_key(TINY, SEQ, torch.float32),
    )
    path = cache_mod.profile_path(TINY, SEQ, torch.float32, torch.device("cpu"), rank_cores(2))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())


@pytest.mark.timeout(300)
def test_a_tuned_2_rank_run_checks_its_prediction_and_warns_when_it_is_off(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SYSX_CACHE_DIR", str(cache))  # profile_path reads it here as the job will
    _slow_profile(cache)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SYSX_JOB_ID", "TORCHELASTIC_RUN_ID")}
    env.update(PYTHONPATH=child_pythonpath(env), OMP_NUM_THREADS="1", SYSX_CACHE_DIR=str(cache))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "sysx.launch",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "sysx.train",
            *JOB,
            f"run_dir={tmp_path / 'run'}",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "schedule.tune (profile cached; p2p" in run.stdout  # the planted profile, with the links just measured
    pred = json.loads((tmp_path / "run" / "summary.json").read_text())["prediction"]
    # clipping at 1.0 vetoes the tiny model's speculation: those steps are predicted validating first
    assert pred["source"] in ("tuned profile", "tuned profile, validating first")
    assert pred["steps"] == [1, 3] and pred["measured_by"] == "step times"
    for key in ("iteration_s", "peak_host_bytes"):
        e = pred[key]
        assert e["predicted"] > 0 and e["measured"] > 0
        assert e["error_pct"] == pytest.approx(100 * (e["measured"] / e["predicted"] - 1))
    assert pred["iteration_s"]["error_pct"] < -90  # 1000x too slow a profile
    assert run.stdout.count("warning: the prediction is off by more than 10%") == 1
    assert f"prediction ({pred['source']}):" in run.stdout
    cached = prof.MachineProfile.from_json(
        cache_mod.profile_path(TINY, SEQ, torch.float32, torch.device("cpu"), rank_cores(2)).read_text()
    )
    assert cached.p2p is not None and cached.p2p.ranks == 2 and cached.p2p.intra_bandwidth > 0  # kept with the profile


def test_the_tiny_message_latency_is_the_fastest_of_many_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-message latency every all-reduce of the plan pays is the fastest of
    :data:`~sysx.autotune.p2p.TINY_ROUNDS` round trips; a large size's of ``ROUNDS`` (one more each
    connects the pair). A slow round trip among them (another rank's time slice) is not the latency."""
    from sysx.autotune import p2p

    trips: list[int] = []
    now = [0.0]

    def send(buf: torch.Tensor, peer: int, group: object = None) -> None:
        trips.append(buf.numel())
        now[0] += 1000.0 if len(trips) == 4 else 1.0  # the third timed tiny round trip is slow

    monkeypatch.setattr(p2p.tdist, "send", send)
    monkeypatch.setattr(p2p.tdist, "recv", lambda buf, peer, group=None: None)
    monkeypatch.setattr(p2p.time, "perf_counter", lambda: now[0])
    one_way = p2p._ping_pong(1, True, torch.device("cpu"), None, (p2p.TINY, 4096))
    assert trips.count(p2p.TINY // 4) == p2p.TINY_ROUNDS + 1 and trips.count(1024) == p2p.ROUNDS + 1
    assert p2p.TINY_ROUNDS >= 10 * p2p.ROUNDS
    assert one_way == [0.5, 0.5]  # each round trip 1 "second" but the slow one: half of it one way


@pytest.mark.parametrize(
    "world,extra,tuned",
    [
        (2, [], True),
        (1, [], False),
        (2, ["schedule.tune=false"], False),
        (2, ["schedule.stages_per_rank=1"], False),
        (4, ["schedule.tune=true", "schedule.split=1"], True),
    ],
)
def test_schedule_tune_defaults_to_true_for_auto_with_several_processes(monkeypatch, world, extra, tuned) -> None:
    import sysx.train as train_mod

    seen = {}
    monkeypatch.setattr(train_mod, "trainer_for", lambda name: lambda cfg, info: seen.update(cfg=cfg) or 0)
    assert load_config([]).schedule.tune is None  # the default: decided when the launch is known
    train_mod.train_auto(load_config(["schedule=auto", *extra]), DistInfo(world_size=world, local_world_size=world))
    assert bool(seen["cfg"].schedule.tune) is tuned


def test_the_hardware_profile_is_measured_once_per_machine_and_shared(monkeypatch, tmp_path) -> None:
    """The single-device planner and the autotune profile read one cached hardware profile; a new
    model shape re-profiles the layers but not the hardware; remeasure / refresh measure again."""
    from sysx.machine import hardware as hw_mod
    from sysx.single.hardware import machine_hardware

    monkeypatch.setenv("SYSX_CACHE_DIR", str(tmp_path))
    calls: list[str] = []
    real = hw_mod.measure_hardware

    def counting(device=None, dtype=torch.float32, **kw):
        calls.append(str(dtype))
        return real(device, dtype, nbytes=1 << 20, repeats=1)

    monkeypatch.setattr(hardware_cache, "measure_hardware", counting)
    monkeypatch.setattr(hardware_cache, "measure_process_bytes", lambda: 1 << 20)  # a fresh interpreter each time
    first = machine_hardware("measure", "cpu")
    assert len(calls) == 1 and first.measured
    again = machine_hardware("measure", "cpu")
    assert len(calls) == 1 and again.h2d_bytes_per_s == first.h2d_bytes_per_s  # the cached rates
    assert hardware_cache.hardware_path(torch.device("cpu"), torch.float32).exists()
    small = dataclasses.replace(TINY, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=2, max_seq_len=64)
    seen: list[object] = []
    monkeypatch.setattr(
        prof,
        "measure_profile",
        lambda cfg, seq, sizes, **kw: seen.append(kw["hardware"]) or synthetic_profile(cfg, seq),
    )
    cache_mod.load_or_measure(small, 16, [1], device="cpu")
    cache_mod.load_or_measure(dataclasses.replace(small, ffn_dim=96), 16, [1], device="cpu")  # a new shape
    assert len(seen) == 2 and len(calls) == 1  # the layers were profiled twice, the hardware measured once
    assert all(h.h2d_bytes_per_s == first.h2d_bytes_per_s for h in seen)  # type: ignore[attr-defined]
    machine_hardware("remeasure", "cpu")
    assert len(calls) == 2
    cache_mod.load_or_measure(small, 16, [1], device="cpu", refresh=True)  # `sysx tune --refresh`
    assert len(calls) == 3 and len(seen) == 3
    assert machine_hardware("v100").name == "v100 (assumed)" and len(calls) == 3


def test_sysx_tune_on_the_emulated_device_measures_nothing(monkeypatch, tmp_path, capsys) -> None:
    from sysx.autotune.cli import main as tune_main
    from sysx.machine import hardware as hw_mod

    monkeypatch.setenv("SYSX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prof, "measure_profile", lambda *a, **k: pytest.fail("the emulated device measured the CPU"))
    monkeypatch.setattr(hw_mod, "measure_hardware", lambda *a, **k: pytest.fail("the emulated device measured the CPU"))
    assert (
        tune_main(
            [
                "--ranks",
                "2",
                "--json",
                "--hydra",
                "device=emulated",
                "emulate.model=llama2_7b",
                "emulate.seq_len=256",
                "emulate.micro_batch_size=2",
                "train.micro_batches=2",
                "train.seq_len=16",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["budget"]["gpu"] == 32 * 2**30 and out["seq_len"] == 256 and out["global_batch"] == 4
    assert out["top"] and all(c["global_batch"] == 4 for c in out["top"])


def test_cpu_ranks_beyond_the_cores_share_them() -> None:
    p = dataclasses.replace(synthetic_profile(), cpu_threads=2)  # kind cpu, 2 physical cores
    one = profiled_costs(p, TINY, 64, 2, gpus_per_node=2).layer_fwd_time
    four = profiled_costs(p, TINY, 64, 2, gpus_per_node=4).layer_fwd_time
    assert four == pytest.approx(tuple(2 * t for t in one))
    gpu = dataclasses.replace(p, hardware=dataclasses.replace(p.hardware, kind="cuda"))
    assert profiled_costs(gpu, TINY, 64, 2, gpus_per_node=4).layer_fwd_time == pytest.approx(one)


def test_the_check_step_follows_the_first_step_and_the_recorded_window() -> None:
    from sysx.autotune.check import check_step, measured_window

    assert check_step(0, 100, None) == 3 and check_step(40, 100, None) == 43  # after a resume at step 40
    assert check_step(0, 2, None) == 1 and check_step(0, 100, 5) == 5
    assert check_step(10, 100, 5) == 13  # a window before the resume point: the step times decide
    assert measured_window([(0, 9.0), (1, 1.0), (2, 3.0)]) == ([1, 2], 2.0)
    assert measured_window([(0, 9.0)]) == ([0], 9.0)


def test_the_check_window_spans_two_seconds_of_steps_within_the_run() -> None:
    """Three steps of a tiny model (0.13 s each) scatter by +-7% between identical runs: the window
    grows until it spans WINDOW_S at the ranks' slowest pace so far, never past the run's last step."""
    from sysx.autotune.check import WINDOW_S, long_enough

    assert WINDOW_S == 2.0
    fast = [(0, 1.0), (1, 0.1), (2, 0.1), (3, 0.1)]
    assert long_enough(3, fast, 100, 0.1) == 3 + 20 - 3  # 20 steps of 0.1 s
    assert long_enough(3, fast, 100, 0.2) == 3 + 10 - 3  # a slower rank's pace: every rank the same step
    assert long_enough(3, fast, 10, 0.1) == 9  # the run ends first
    assert long_enough(3, [(0, 1.0), (1, 0.7), (2, 0.7), (3, 0.7)], 100, 0.7) == 3  # 2.1 s: long enough
    assert long_enough(13, [(10, 1.0), (11, 0.5), (12, 0.5), (13, 0.5)], 100, 0.5) == 14  # after a resume


def test_the_single_trainer_checks_its_planners_prediction(capsys) -> None:
    from types import SimpleNamespace

    from sysx.metrics import StepResult
    from sysx.trainers.prediction import SinglePrediction

    plan = SimpleNamespace(times={"step_s": 0.5}, device_bytes={"total": 1 << 20}, host_bytes={"total": 3 << 20})
    check = SinglePrediction(plan, torch.device("cpu"))
    for step, seconds in enumerate((9.0, 0.5, 0.6, 0.7, 0.6, 0.6)):
        check.after_step(
            StepResult(
                step=step, loss=1.0, lr=1e-3, grad_norm=1.0, skipped=False, scale=1.0, tokens=1, step_time_s=seconds
            ),
            10,
            None,
        )
    s = check.section
    # steps 1-3 span 1.8 s, under WINDOW_S (2 s): one more step of 0.6 s is measured
    assert s["source"] == "single-device planner" and s["steps"] == [1, 4]
    assert s["iteration_s"]["measured"] == pytest.approx(0.6) and s["iteration_s"]["error_pct"] == pytest.approx(20.0)
    assert s["peak_host_bytes"]["predicted"] == 4 << 20  # on CPU the device buffers are host memory too
    assert "warning: the prediction is off by more than 10% (iteration_s" in capsys.readouterr().out


@pytest.mark.parametrize(("optimizer_s", "predicted"), [(0.0, 0.5), (0.3, 0.5), (0.8, 0.8)])
def test_the_window_s_prediction_waits_for_the_optimizer_holding_the_next_forward(
    optimizer_s: float, predicted: float
) -> None:
    """Validating first (every fresh model's first steps), the optimizer runs after the backward and
    the next forward waits for it: the step is the later of the planner's passes and the placement's
    finish (an H200 measured a 50M window at 0.42 s a step, its passes priced at 0.10 s)."""
    from types import SimpleNamespace

    from sysx.metrics import StepResult
    from sysx.trainers.prediction import SinglePrediction

    plan = SimpleNamespace(times={"step_s": 0.5}, device_bytes={"total": 1 << 20}, host_bytes={"total": 3 << 20})
    check = SinglePrediction(plan, torch.device("cpu"))
    check.optimizer_s = optimizer_s
    for step in range(6):
        result = StepResult(
            step=step, loss=1.0, lr=1e-3, grad_norm=1.0, skipped=False, scale=1.0, tokens=1, step_time_s=0.8
        )
        check.after_step(result, 6, None)
    assert check.section["iteration_s"]["predicted"] == pytest.approx(predicted)
