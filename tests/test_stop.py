"""Stopping a job: SIGINT/SIGTERM end every rank cleanly, a failed rank ends the others quickly.

For 2 ranks started as torchrun starts them (one process group): SIGINT to the whole process group,
SIGTERM to one rank, SIGKILL to one rank. Under ``launch/torchrun.sh`` and ``launch/mpirun.sh``: SIGINT
to the group under each, SIGKILL to one rank under torchrun, SIGTERM to one rank under mpirun.
Each case checks the time from the signal to the exit of every rank (< 20 s for a signal, < 40 s
for SIGKILL, measured generously: from just after the signal to the moment the test sees the
exit; the bounds are loose so that a busy machine passes, while a
rank that waits for ``schedule.timeout_s=120`` still fails), the exit status (130 / 143; 1 for the survivors of a SIGKILL), at most one line per rank on
stderr and no traceback, ``"stopped"`` in ``summary.json``, no shared-memory segment of the job
and no process of the job left. Plus one process (Ctrl-C: 130, one line, summary.json) and
``checkpoint.on_signal=true`` (the stop saves a checkpoint first).

The children get SIGINT's default action back before they start: a job started in the
background by a non-interactive shell (as CI may start pytest) inherits SIGINT ignored, and sysx
rightly leaves an ignored signal alone.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from test_runtime_procs import ROOT, VENV_BIN, free_port, rank_env

SIGNAL_STOP_S = 20.0
KILL_STOP_S = 40.0
JOB_ARGS = [
    "schedule=sysx",
    "parallel.replicas=1",  # a pipeline over every rank (the tuner may choose replicas of the tiny model otherwise)
    "train.steps=100000",
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "eval.every=0",
    "log.every=1",
    "device=cpu",
    "optim.backend=torch",
    "schedule.timeout_s=120",
]


def _interactive_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Job:
    """A running job: its top processes (the ranks, or a launcher), rank 0's output, a marker
    in the environment of every process it starts, its shared-memory job id."""

    def __init__(self, tmp_path: Path, procs: list[subprocess.Popen], job: str, mark: str) -> None:
        self.tmp_path, self.procs, self.job, self.mark = tmp_path, procs, job, mark
        self.stdout: list[str] = []
        self.stderr: list[list[str]] = [[] for _ in procs]
        self._readers = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(len(procs))]
        for reader in self._readers:
            reader.start()

    def _read(self, i: int) -> None:
        proc = self.procs[i]
        assert proc.stdout is not None and proc.stderr is not None
        err = threading.Thread(target=lambda: self.stderr[i].extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
        err.start()
        for line in proc.stdout:
            if i == 0:
                self.stdout.append(line)
        err.join()

    def wait_for_step(self, step: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        pattern = re.compile(rf"step +{step}/")
        while time.monotonic() < deadline:
            if any(pattern.match(line) for line in list(self.stdout)):
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.05)
        pytest.fail(f"the job did not reach step {step}: {''.join(self.stdout)[-2000:]} {self.errors()}")

    def rank_pids(self) -> list[int]:
        """Pids of the job's sysx-train ranks, by rank (found by the marker in their environment)."""
        found: dict[int, int] = {}
        for pid, env in self._marked():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:  # gone since _marked listed it (a launch script's short-lived helpers)
                continue
            if b"sysx.train" in cmd and b"-m" in cmd and (b"RANK" in env or b"PMI_RANK" in env):
                rank = env.get(b"RANK", env.get(b"PMI_RANK"))
                found[int(rank)] = pid
        return [found[r] for r in sorted(found)]

    def _marked(self) -> list[tuple[int, dict[bytes, bytes]]]:
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                raw = Path(f"/proc/{entry}/environ").read_bytes()
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            env = dict(item.partition(b"=")[::2] for item in raw.split(b"\0") if item)
            if env.get(b"SYSX_TEST_MARK") == self.mark.encode() and state != "Z":
                out.append((int(entry), env))
        return out

    def wait_all(self, timeout: float) -> float:
        """Seconds until every top process has exited (fails after ``timeout``)."""
        t0 = time.monotonic()
        for p in self.procs:
            p.wait(timeout=max(0.1, timeout - (time.monotonic() - t0)))
        for reader in self._readers:
            reader.join(timeout=10)
        return time.monotonic() - t0

    def errors(self) -> list[str]:
        return ["".join(lines)[-2000:] for lines in self.stderr]

    def check_nothing_left(self) -> None:
        deadline = time.monotonic() + 5  # guardians (own sessions) exit when their rank's pipe closes
        while (self._marked() or glob.glob(f"/dev/shm/sysx-*-{self.job}*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert glob.glob(f"/dev/shm/sysx-*-{self.job}*") == []
        assert [pid for pid, _ in self._marked()] == []

    def kill(self) -> None:
        for pid, _ in self._marked():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def start_ranks(tmp_path: Path, world: int = 2, args: list[str] | None = None) -> Job:
    """``world`` ranks as torchrun starts them, in one new process group (led by rank 0)."""
    job, mark, port = f"stop{uuid.uuid4().hex[:8]}", uuid.uuid4().hex, free_port()
    argv = [sys.executable, "-m", "sysx.train", *JOB_ARGS, f"run_dir={tmp_path / 'run'}", *(args or [])]
    procs: list[subprocess.Popen] = []
    for r in range(world):
        procs.append(
            subprocess.Popen(
                argv,
                env=rank_env(r, world, world, port, SYSX_JOB_ID=job, SYSX_TEST_MARK=mark),
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=_interactive_signals,
                process_group=0 if r == 0 else procs[0].pid,
            )
        )
    return Job(tmp_path, procs, job, mark)


def launcher_env(job: str, mark: str, **extra: str) -> dict[str, str]:
    """The environment a launcher starts in: this venv, one thread per rank, a free port (``PORT``),
    2 processes (``NP``; ``NPROC`` unless ``extra`` says), the job id and the test's marker."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SYSX_JOB_ID", "RANK", "WORLD_SIZE")}
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        PATH=f"{VENV_BIN}:{env.get('PATH', '')}",
        NPROC="2",
        NP="2",
        PORT=str(free_port()),
        PYTHON=sys.executable,
        SYSX_JOB_ID=job,
        SYSX_TEST_MARK=mark,
    )
    env.update(extra)
    return env


def start_launcher(tmp_path: Path, launcher: str, args: list[str] | None = None, **extra_env: str) -> Job:
    """2 ranks through a launcher sysx ships, in a new session: ``sysx.launch`` (torchrun through
    ``python -m sysx.launch``, no pre-flight), ``torchrun`` / ``mpirun`` (``launch/<name>.sh``) or
    ``two_nodes`` (``launch/two_nodes_localhost.sh``, one rank per "node")."""
    job, mark = f"stop{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    # extra_env may replace the defaults (NPROC=2: 4 ranks under two_nodes)
    env = launcher_env(job, mark, **{"NPROC": "1" if launcher == "two_nodes" else "2", **extra_env})
    job_args = [*(JOB_ARGS if args is None else args), f"run_dir={tmp_path / 'run'}"]
    if launcher == "sysx.launch":
        torchrun_args = env.get("TORCHRUN_ARGS", "").split()  # as the launch scripts take them
        argv = [sys.executable, "-m", "sysx.launch", "--standalone", "--nproc_per_node=2", *torchrun_args]
        argv += ["-m", "sysx.train"]
    else:
        argv = ["bash", str(ROOT / "launch" / f"{'two_nodes_localhost' if launcher == 'two_nodes' else launcher}.sh")]
    return Job(tmp_path, [spawn([*argv, *job_args], env, tmp_path)], job, mark)


def spawn(argv: list[str], env: dict[str, str], cwd: Path, new_session: bool = True) -> subprocess.Popen:
    """A job's top process, its output piped as text, with SIGINT's default action (and, unless
    ``new_session`` is False, in a session of its own, as a launcher started from a terminal)."""
    return subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interactive_signals,
        start_new_session=new_session,
    )


AGENT_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d")  # the glog-style lines of torchrun's agent
GUARDIAN_LINE = "sysx shm guardian: "  # a killed rank's shared-memory guardian, one line per segment it removed


def check_launcher_report(job: Job, world: int = 2, proc: int = 0) -> list[str]:
    """What a launcher's stderr (that of ``job.procs[proc]``) may hold: per rank at most its own
    ``sysx-train`` line and one ``sysx.launch`` line naming it (plus a killed rank's guardian lines);
    no traceback, no line of torchrun's agent. Returns the lines, guardian lines left out."""
    text = "".join(job.stderr[proc])
    lines = [x for x in text.splitlines() if x.strip() and not x.startswith(GUARDIAN_LINE)]
    assert "Traceback" not in text, text
    assert not [x for x in lines if AGENT_LINE.match(x)], text
    assert all(x.startswith(("sysx-train", "sysx.launch: ")) for x in lines), text
    for rank in range(world):
        assert len([x for x in lines if x.startswith(f"sysx.launch: rank {rank} ")]) <= 1, text
        assert len([x for x in lines if x.startswith(f"sysx-train: rank {rank}: ")]) <= 1, text
    assert len(lines) <= 2 * world, text
    print(f"\n  stderr: {text.strip()}")
    return lines


def check_one_line_per_rank(job: Job, skip: int | None = None) -> None:
    """Every top process wrote at most one line to stderr per rank it stands for (``skip``: a
    SIGKILLed rank, whose stderr has its shared-memory guardian's report)."""
    per_process = 1 if len(job.procs) > 1 else 2
    for i, lines in enumerate(job.stderr):
        if i == skip:
            continue
        text = "".join(lines)
        assert len([x for x in lines if x.strip()]) <= per_process, text
        assert "Traceback" not in text, text
        print(f"\n  stderr: {text.strip()}")


def check_stopped_summary(job: Job, name: str) -> None:
    summary = json.loads((job.tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped"] == name, summary
    assert summary["steps"] >= 2


def signal_case(job: Job, how: str, signum: int) -> float:
    job.wait_for_step(2)
    pids = job.rank_pids()
    assert len(pids) == 2, pids
    if how == "group":
        os.killpg(os.getpgid(job.procs[0].pid), signum)
    else:
        os.kill(pids[1 if how == "rank1" else 0], signum)
    return job.wait_all(timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("how", "signum"), [("group", signal.SIGINT), ("rank1", signal.SIGTERM), ("rank0", signal.SIGTERM)]
)
def test_a_signal_stops_every_rank_cleanly(tmp_path: Path, how: str, signum: int) -> None:
    job = start_ranks(tmp_path)
    try:
        elapsed = signal_case(job, how, signum)
        print(f"\n{how} {signal.Signals(signum).name}: every rank exited {elapsed:.2f} s after the signal")
        assert [p.returncode for p in job.procs] == [128 + signum] * 2, job.errors()
        assert elapsed < SIGNAL_STOP_S, job.errors()
        check_one_line_per_rank(job)
        check_stopped_summary(job, signal.Signals(signum).name)
        job.check_nothing_left()
    finally:
        job.kill()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_rank_stops_the_other_quickly_naming_it(tmp_path: Path, victim: int) -> None:
    job = start_ranks(tmp_path)
    try:
        job.wait_for_step(2)
        os.kill(job.procs[victim].pid, signal.SIGKILL)
        elapsed = job.wait_all(timeout=60)
        survivor = 1 - victim
        print(
            f"\nrank {victim} SIGKILLed: rank {survivor} exited {elapsed:.2f} s later: {job.errors()[survivor][-400:]}"
        )
        assert job.procs[victim].returncode == -signal.SIGKILL
        assert job.procs[survivor].returncode == 1, job.errors()
        assert elapsed < KILL_STOP_S
        assert f"rank {victim} died" in job.errors()[survivor]
        check_one_line_per_rank(job, skip=victim)
        job.check_nothing_left()
    finally:
        job.kill()


@pytest.mark.slow
@pytest.mark.timeout(240)
# Ctrl-C through each launcher, and a rank dying under each: SIGKILL (the OOM killer's) under
# torchrun, SIGTERM (a scheduler's) under mpirun: both deaths under both launchers took ~25 s more
# of the suite's budget, and the ranks' own stop on each signal has its tests above
@pytest.mark.parametrize(
    ("launcher", "how", "signum"),
    [
        ("torchrun", "group", signal.SIGINT),
        ("torchrun", "rank1", signal.SIGKILL),
        ("mpirun", "group", signal.SIGINT),
        ("mpirun", "rank1", signal.SIGTERM),
    ],
)
def test_launchers_stop_every_rank(tmp_path: Path, launcher: str, how: str, signum: int) -> None:
    job = start_launcher(tmp_path, launcher)
    try:
        elapsed = signal_case(job, how, signum)
        rc = job.procs[0].returncode
        print(
            f"\n{launcher}: {how} {signal.Signals(signum).name}: the launcher and every rank exited {elapsed:.2f} s "
            f"after the signal, status {rc}"
        )
        assert elapsed < (KILL_STOP_S if signum == signal.SIGKILL else SIGNAL_STOP_S)
        assert rc != 0
        # launch/torchrun.sh runs torchrun through sysx.launch: it exits like the job, without its agent's lines
        check_launcher_report(job)
        if signum != signal.SIGKILL:
            assert launcher == "mpirun" or rc == 128 + signum, (rc, job.errors())
            check_stopped_summary(job, signal.Signals(signum).name)
        job.check_nothing_left()
    finally:
        job.kill()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["reference", "single"])
def test_one_process_ctrl_c(tmp_path: Path, schedule: str) -> None:
    job, mark = f"stop{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SYSX_JOB_ID")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", SYSX_JOB_ID=job, SYSX_TEST_MARK=mark)
    argv = [
        sys.executable,
        "-m",
        "sysx.train",
        f"schedule={schedule}",
        "train.steps=100000",
        "train.seq_len=16",
        "train.micro_batch_size=2",
        "eval.every=0",
        "log.every=1",
        "device=cpu",
        f"run_dir={tmp_path / 'run'}",
    ]
    proc = spawn(argv, env, tmp_path, new_session=False)
    run = Job(tmp_path, [proc], job, mark)
    try:
        run.wait_for_step(2)
        proc.send_signal(signal.SIGINT)
        run.wait_all(timeout=60)
        assert proc.returncode == 130, run.errors()
        lines = [x for x in run.stderr[0] if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("sysx-train: stopped by SIGINT at step "), lines
        check_stopped_summary(run, "SIGINT")
        run.check_nothing_left()
    finally:
        run.kill()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_on_signal_saves_a_checkpoint_before_stopping(tmp_path: Path) -> None:
    job = start_ranks(tmp_path, args=["checkpoint.on_signal=true"])
    try:
        elapsed = signal_case(job, "rank1", signal.SIGTERM)
        assert [p.returncode for p in job.procs] == [143, 143], job.errors()
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.is_dir())
        print(f"\non_signal: stopped {elapsed:.2f} s after SIGTERM to rank 1, after step {summary['steps']}: {saved}")
        assert summary["stopped"] == "SIGTERM" and saved, saved
        assert any(f"{summary['steps']:08d}" in name or str(summary["steps"]) in name for name in saved), saved
        check_one_line_per_rank(job)
        job.check_nothing_left()
    finally:
        job.kill()


def test_the_loop_ends_on_a_stop_every_rank_knows_of() -> None:
    """A signal that reaches a rank after its step's all-reduce is carried by the next step's: the
    rank runs that step too, so every rank saves after the same step (a save's collectives pair up;
    a rank that left early hung its peers' next step in CI)."""
    from types import SimpleNamespace

    from sysx import stopping
    from sysx.trainers.base import Trainer

    agreed = iter([False, True])
    fake = SimpleNamespace(
        cfg=SimpleNamespace(train=SimpleNamespace(steps=5), eval=SimpleNamespace(every=0)),
        step=0,
        finish_pending=lambda: None,
        stop_agreed=lambda: next(agreed),
    )

    def train_step() -> SimpleNamespace:
        fake.step += 1
        stopping.request(signal.SIGTERM)  # the signal came after this step's all-reduce
        return SimpleNamespace(step=fake.step - 1, val_loss=None)

    fake.train_step = train_step
    try:
        results = Trainer.run(fake, 5)  # type: ignore[arg-type]
    finally:
        stopping.reset()
    assert [r.step for r in results] == [0, 1]
