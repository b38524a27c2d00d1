"""The multi-process runtime on CPU with gloo: every schedule equals the single-process reference.

Each launch starts its ranks the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT in the environment) and runs many schedules in sequence in one process group
(tests/runtime_parity_job.py), each against the reference trained in-process by rank 0 with the
same seed and batches. fp32: per-step losses and final parameters within 1e-5 (relative).

* 2 ranks, one node: gpipe, 1f1b, interleaved_1f1b, mobius, sysx d=1/2/3, CFG0-CFG3 and snapshot,
  exact and auto rollback (the tiny model as it is, 6 flat layers);
* 4 ranks as 2 "nodes" x 2 (LOCAL_WORLD_SIZE=2): the same plus sysx d=4, with the tiny model's
  dimensions and 14 blocks so that 8 stages and d=4 fit; parameters of stages owned on the other
  node reach the forward ranks through mirror segments (the multi-node path);
* one rank SIGKILLed mid-step: the others stop with an error naming rank, op and peer, quickly,
  and no shared-memory segment of the job is left;
* the launch scripts: two torchrun "nodes" on localhost and mpiexec through mpi4py.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def child_pythonpath(env: Mapping[str, str]) -> str:
    """The repository first on the child's path, what the parent had after it (on the GPU machine,
    the carried wheels' folder)."""
    return os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))


VENV_BIN = Path(sys.executable).parent
JOB_SCRIPT = ROOT / "tests" / "runtime_parity_job.py"
TOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, local_world: int, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SYSX_JOB_ID")}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % local_world),
        LOCAL_WORLD_SIZE=str(local_world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=child_pythonpath(env),
        **extra,
    )
    return env


def launch(
    argv: list[str], world: int, local_world: int, timeout: float, **extra: str
) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = [
        subprocess.Popen(
            argv,
            env=rank_env(r, world, local_world, port, **extra),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def run_parity(
    tmp_path: Path,
    *,
    world: int,
    local_world: int,
    model: dict,
    train: dict,
    schedules: list[dict],
    steps: int = 3,
    optim: dict | None = None,
    replicas: int = 1,
    tol: float = TOL,
    data: str | None = None,
    precision: str = "auto",
) -> dict:
    spec = {
        "data": data,
        "precision": precision,
        "replicas": replicas,
        "model": model,
        "train": train,
        "steps": steps,
        "optim": optim or {},
        "schedules": schedules,
        "timeout_s": 60,
    }
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(json.dumps(spec))
    procs = launch([sys.executable, str(JOB_SCRIPT), str(spec_path), str(out_path)], world, local_world, timeout=240)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    result = json.loads(out_path.read_text())
    print(
        f"\n{world} ranks on {result['nodes']} node(s): schedule | Nsf d ckpt optimizer | loss rel | grad-norm rel | "
        f"param rel (whole / worst tensor) | max abs"
    )
    for row in result["rows"]:
        print(
            f"  {row['options']} | {row['n_stages']} {row['split']} {row['ckpt']} {row['optimizer']} | "
            f"{row['loss_rel']:.1e} | {row['grad_norm_rel']:.1e} | {row['param_rel']:.1e} / "
            f"{row['param_rel_per_tensor']:.1e} | {row['param_max_abs']:.1e}"
        )
    assert len(result["rows"]) == len(schedules)
    for row in result["rows"]:
        assert row["loss_rel"] <= tol, row
        assert row["param_rel"] <= tol and row["param_rel_per_tensor"] <= tol, row
        assert row["grad_norm_rel"] <= tol, row
    return result


EVERY_SCHEDULE_2 = [
    {"schedule": "gpipe"},
    {"schedule": "1f1b"},
    {"schedule": "interleaved_1f1b"},
    {"schedule": "mobius"},
    {"schedule": "sysx", "split": 1},
    {"schedule": "sysx", "split": 2, "stages_per_rank": 1},
    {"schedule": "sysx", "split": 3, "stages_per_rank": 1},
    {"schedule": "sysx", "cfg": 0},
    {"schedule": "sysx", "cfg": 1, "split": 2, "stages_per_rank": 1},
    {"schedule": "sysx", "cfg": 2, "split": 2, "stages_per_rank": 1},
    {"schedule": "sysx", "cfg": 3, "split": 2, "stages_per_rank": 1, "rollback": "snapshot"},
    {"schedule": "sysx", "cfg": 3, "split": 2, "stages_per_rank": 1, "rollback": "exact"},
    {"schedule": "sysx", "cfg": 3, "split": 2, "stages_per_rank": 1, "rollback": "auto"},
    # the forward's graph kept for the backward (no recompute); interleaved and mobius swap stages through the buffers
    {"schedule": "gpipe", "keep_activations": True},
    {"schedule": "1f1b", "keep_activations": True},
    {"schedule": "interleaved_1f1b", "keep_activations": True},
    {"schedule": "mobius", "keep_activations": True},
]


def test_every_schedule_matches_the_reference_on_2_ranks(tmp_path: Path) -> None:
    result = run_parity(
        tmp_path,
        world=2,
        local_world=2,
        model={"preset": "tiny"},
        train={"micro_batch_size": 2, "micro_batches": 3, "seq_len": 16},
        schedules=EVERY_SCHEDULE_2,
    )
    rows = result["rows"]
    assert [r["split"] for r in rows if r["options"]["schedule"] == "sysx"] == [1, 2, 3, 1, 2, 2, 2, 2, 2]
    # fp32: the exact rollback steps a private master and keeps the shared fp32 copy current;
    # auto picks exact where the tiny model's buffers fit (every node agrees)
    assert rows[11]["rollbacks"] == ["exact"] and rows[12]["rollbacks"] == ["exact"], rows[11:]
    assert {r["ckpt"] for r in rows[:4]} == {"local"} and rows[7]["ckpt"] == "sync" and rows[9]["ckpt"] == "async"
    assert rows[9]["optimizer"] == "sync" and rows[10]["optimizer"] == "async"
    assert all(r["mirrored_units"] == 0 for r in rows)  # one node: every rank attaches the node's segments
    assert [r["keep_activations"] for r in rows] == [False] * 13 + [True] * 4


EVERY_SCHEDULE_4 = [
    {"schedule": "gpipe"},
    {"schedule": "1f1b"},
    {"schedule": "interleaved_1f1b"},
    {"schedule": "mobius"},
    {"schedule": "sysx", "split": 1},
    {"schedule": "sysx", "split": 2},
    {"schedule": "sysx", "split": 3, "stages_per_rank": 1},
    {"schedule": "sysx", "split": 4, "stages_per_rank": 1},
    {"schedule": "sysx", "cfg": 0},
    {"schedule": "sysx", "cfg": 1},
    {"schedule": "sysx", "cfg": 2},
    # the Head alone: micro-batches 1 and 3 take its input gradient from its forward on rank 3, across the
    # nodes, and every backward runs in 2 parts (the default there), their gradients sent part by part
    {"schedule": "sysx", "split": 1, "stage_sizes": [3, 2, 2, 2, 2, 2, 2, 1], "head_input_grad": 2},
    # backward parts with 2 sub-stages a stage: each checkpoint received once, read by both parts
    {"schedule": "sysx", "split": 2, "backward_parts": 2},
]


def test_every_schedule_matches_the_reference_on_4_ranks_in_2_nodes(tmp_path: Path) -> None:
    result = run_parity(
        tmp_path,
        world=4,
        local_world=2,
        model={"preset": "tiny", "n_layers": 14},
        train={"micro_batch_size": 2, "micro_batches": 4, "seq_len": 16},
        schedules=EVERY_SCHEDULE_4,
    )
    assert result["nodes"] == 2
    rows = {json.dumps(r["options"], sort_keys=True): r for r in result["rows"]}
    d4 = rows[json.dumps({"schedule": "sysx", "split": 4, "stages_per_rank": 1}, sort_keys=True)]
    assert (d4["n_stages"], d4["split"]) == (4, 4)
    sysx_full = rows[json.dumps({"schedule": "sysx", "split": 2}, sort_keys=True)]
    assert (sysx_full["n_stages"], sysx_full["split"], sysx_full["ckpt"], sysx_full["optimizer"]) == (
        8,
        2,
        "async",
        "async",
    )
    # decoupled placement across 2 nodes: forward ranks need sub-stages owned on the other node
    assert sysx_full["mirrored_units"] > 0
    parts = {k: r["backward_parts"] for k, r in rows.items() if r["backward_parts"] > 1}
    assert len(parts) == 2, parts  # the Head alone's default, and the one asked for
    assert (
        rows[json.dumps({"schedule": "gpipe"}, sort_keys=True)]["mirrored_units"] == 0
    )  # coupled: owner = forward rank


PAST_WARMUP = [
    {"schedule": "sysx", "cfg": 3, "split": 2, "stages_per_rank": 1},  # async per-stage optimizer, torch backend
    {"schedule": "sysx", "cfg": 3, "split": 2, "stages_per_rank": 1, "optim_backend": "deepspeed"},
    {"schedule": "gpipe", "optim_backend": "deepspeed"},  # synchronous optimizer after the flush
]


def test_deepspeed_backend_and_steps_past_warmup_match_the_reference(tmp_path: Path) -> None:
    """8 steps, warmup 2, at a stable learning rate (1e-3, see profiling/check_lr_stability.py): the
    cosine phase, and DeepSpeed's CPU Adam (the default backend) against torch AdamW in the reference
    (measured: parameters 1.8e-7 relative after 8 steps, like the torch backend)."""
    optim = {"lr": 1e-3, "warmup_steps": 2, "min_lr": 1e-4}
    result = run_parity(
        tmp_path,
        world=2,
        local_world=2,
        model={"preset": "tiny"},
        train={"micro_batch_size": 2, "micro_batches": 3, "seq_len": 16},
        schedules=PAST_WARMUP,
        steps=8,
        optim=optim,
    )
    for row in result["rows"]:
        assert row["lrs"][2] == optim["lr"] and row["lrs"][-1] < optim["lr"] / 2, row["lrs"]  # warmup done, decaying
        assert row["losses"][-1] < row["losses"][0] - 0.5, row["losses"]  # it trains
    assert [r["backends"] for r in result["rows"]] == [["torch"], ["deepspeed"], ["deepspeed"]]  # rank 0's


def test_a_killed_rank_stops_the_others_with_a_clear_error_and_no_leak(tmp_path: Path) -> None:
    job = f"kill{uuid.uuid4().hex[:8]}"
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "sysx.train",
        "schedule=sysx",
        "train.steps=1000",
        "train.seq_len=16",
        "train.micro_batch_size=2",
        "eval.every=0",
        "log.every=1",
        "device=cpu",
        "optim.backend=torch",
        "schedule.timeout_s=20",
        f"run_dir={tmp_path / 'run'}",
    ]
    procs = [
        subprocess.Popen(
            argv,
            env=rank_env(r, 3, 3, port, SYSX_JOB_ID=job),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    try:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:  # rank 0 logs every step; kill rank 1 while the next steps run
            if re.match(r"step +2/", line):
                break
        else:
            pytest.fail(f"rank 0 ended before step 2: {procs[0].communicate()[1][-2000:]}")
        assert glob.glob(f"/dev/shm/sysx-*-{job}.t0-*"), "the job has no segments while it runs"
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for r in (0, 2):
            _, err = procs[r].communicate(timeout=60)
            elapsed = time.monotonic() - killed_at
            line = [x for x in err.splitlines() if x.startswith("sysx-train:")]
            assert procs[r].returncode == 1, err[-2000:]
            assert elapsed < 20 + 10, elapsed  # within the timeout (gloo notices the closed connection at once)
            # the error names the rank and where it stopped: an op of the schedule (`op #k ...`), or the
            # end-of-step loss all-reduce when the peer died between the last op and that collective
            assert line and f"rank {r}: error: rank {r}" in line[0], err[-2000:]
            assert "op #" in line[0] or "all-reduce" in line[0], err[-2000:]
            print(f"\nrank {r} exited after {elapsed:.1f} s: {line[0][:400]}")
        procs[1].wait(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    deadline = time.monotonic() + 5  # the killed rank's guardian unlinks its segments
    while glob.glob(f"/dev/shm/sysx-*-{job}*") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert glob.glob(f"/dev/shm/sysx-*-{job}*") == []


LAUNCH_ARGS = [
    "train.steps=3",
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "eval.every=2",
    "eval.batches=2",
    "log.every=1",
    "device=cpu",
    "optim.backend=torch",
]


def script_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SYSX_JOB_ID", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PATH=f"{VENV_BIN}:{env.get('PATH', '')}")
    return env


def read_losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_torchrun_nodes_on_localhost_and_mpirun(tmp_path: Path) -> None:
    env = script_env()
    two = subprocess.run(
        [
            "bash",
            str(ROOT / "launch" / "two_nodes_localhost.sh"),
            "schedule=sysx",
            *LAUNCH_ARGS,
            "train.micro_batches=4",  # the union of the mpirun job's 2 replicas x 2 micro-batches
            f"run_dir={tmp_path / 'two'}",
        ],
        env={**env, "NPROC": "1", "PORT": str(free_port())},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 rank(s) on 2 node(s)" in two.stdout and "done: 3 steps" in two.stdout, two.stdout
    # a run_dir each rank resolves to another path (${now:...} at its own start): every rank takes rank 0's
    per_rank = f"run_dir={tmp_path / 'mpi'}/" + "${now:%H%M%S-%f}"
    replicas = ["parallel.replicas=2", "train.micro_batches=2"]  # 2 replicas of the 2-rank pipeline above
    mpi = subprocess.run(
        ["bash", str(ROOT / "launch" / "mpirun.sh"), "schedule=sysx", *LAUNCH_ARGS, *replicas, per_rank],
        env={**env, "NP": "4", "PYTHON": sys.executable},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert mpi.returncode == 0, mpi.stderr[-3000:]
    assert "on 2 rank(s) x 2 replicas" in mpi.stdout, mpi.stdout  # the pre-flight planned 2 pipelines
    assert "4 rank(s) on 1 node(s)" in mpi.stdout and "done: 3 steps" in mpi.stdout, mpi.stdout
    assert "2 replica(s) x 2 pipeline rank(s)" in mpi.stdout, mpi.stdout
    # the same batches on 2 "nodes" (mirrors) and as 2 replicas on 1 node (attached segments, gradients
    # summed in shared memory) compute the same losses
    [mpi_run] = list((tmp_path / "mpi").iterdir())  # one run directory: checkpoints and metrics all in it
    assert (mpi_run / "summary.json").is_file() and (mpi_run / "checkpoints" / "latest").exists()
    assert read_losses(tmp_path / "two") == pytest.approx(read_losses(mpi_run), rel=1e-6)
