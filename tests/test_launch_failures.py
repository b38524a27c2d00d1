"""Every launcher sysx ships x every way a job fails: the exit status, one line per failing rank,
no traceback, no line of the launcher's agent.

Launchers: ``python -m sysx.launch`` (no pre-flight), ``launch/torchrun.sh`` (pre-flight, then
sysx.launch), ``launch/mpirun.sh``, ``launch/two_nodes_localhost.sh``. Failures: a key the
ranks reject (the pre-flight of torchrun.sh / mpirun.sh catches it first, with the same line and
status), a rank raising mid-step and a rank SIGKILLed mid-step (both through the ``SYSX_FAULT``
fault-injection hook, :mod:`sysx.faults`: no waiting for output), Ctrl-C (SIGINT to the launcher's
process group, as a terminal sends it). SIGINT and SIGKILL under torchrun.sh and mpirun.sh, started
from outside, are :func:`test_stop.test_launchers_stop_every_rank`'s cases (with the same checks of
the launcher's report); torchrun.sh is sysx.launch after its pre-flight, so the mid-step failures
run under sysx.launch alone (the cases cost a job start each: the matrix is kept to what differs).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_stop import (
    JOB_ARGS,
    KILL_STOP_S,
    SIGNAL_STOP_S,
    Job,
    check_launcher_report,
    check_stopped_summary,
    launcher_env,
    spawn,
    start_launcher,
)

from sysx.launch import (
    SHARED_STORE_OPT_OUT,
    AgentSignals,
    RendezvousHostWatch,
    fresh_store_per_attempt,
    install_agent_signals,
    outcome,
    outlive_the_rendezvous_host,
)


@pytest.mark.parametrize(
    ("failures", "status", "lines"),
    [
        ([(1, -9), (0, 143)], 137, ["sysx.launch: rank 1 failed: killed by SIGKILL (exit status 137)"]),
        ([(0, 2), (1, -15)], 2, ["sysx.launch: rank 0 failed: exit status 2"]),
        (
            [(1, 1), (0, 1)],
            1,
            ["sysx.launch: rank 0 failed: exit status 1", "sysx.launch: rank 1 failed: exit status 1"],
        ),
        ([(0, 130), (1, 130)], 130, []),  # Ctrl-C: the ranks said so
        ([(1, 143), (0, -15)], 143, []),  # SIGTERM to rank 1; rank 0 stopped with it
    ],
)
def test_the_job_status_and_one_line_per_failed_rank(failures: list, status: int, lines: list[str]) -> None:
    assert outcome({rank: SimpleNamespace(exitcode=code) for rank, code in failures}) == (status, lines)


LAUNCHERS = ["sysx.launch", "torchrun", "mpirun", "two_nodes"]
FAULT_ARGS = [a for a in JOB_ARGS if not a.startswith("train.steps=")] + ["train.steps=4"]
FAULT_STEP = "step 2"
BAD_KEY = "parallel.pipelines=2"


def test_the_agent_stops_its_ranks_once_with_the_signal_it_got(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that reaches the agent twice (the script's trap forwards it) is one stop, and every
    shutdown of the ranks after it sends SIGINT: torchrun's own handler raised on the repeat, and
    its ``finally`` then sent SIGTERM (test_ctrl_c_on_two_nodes read "stopped by SIGTERM" once in CI)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api as mp_api

    now = [100.0]
    signals = AgentSignals(clock=lambda: now[0])
    assert signals.death_signal(signal.SIGTERM) == signal.SIGTERM  # no signal yet: torchrun's choice
    with pytest.raises(mp_api.SignalException) as first:
        signals.handler(signal.SIGINT, None)
    assert first.value.sigval == signal.SIGINT
    now[0] += 0.5
    signals.handler(signal.SIGINT, None)  # the forwarded repeat: no second exception
    signals.handler(signal.SIGTERM, None)
    assert signals.death_signal(signal.SIGTERM) == signal.SIGINT
    now[0] += 3.0
    with pytest.raises(mp_api.SignalException):  # after the grace: the user insists
        signals.handler(signal.SIGTERM, None)

    # installed: torch's process context takes the handler, and the agent's shutdown the signal
    monkeypatch.setattr(mp_api, "_terminate_process_handler", mp_api._terminate_process_handler)
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", LocalElasticAgent._shutdown)
    sent: list[signal.Signals] = []
    context = SimpleNamespace(close=lambda death_sig, timeout: sent.append(death_sig))
    agent = SimpleNamespace(_worker_watchdog=None, _health_check_server=None, _pcontext=context)
    installed = install_agent_signals(AgentSignals())
    assert mp_api._terminate_process_handler == installed.handler
    LocalElasticAgent._shutdown(agent)  # type: ignore[arg-type]
    with pytest.raises(mp_api.SignalException):
        installed.handler(signal.SIGINT, None)
    LocalElasticAgent._shutdown(agent, timeout=5)  # type: ignore[arg-type]
    assert sent == [signal.SIGTERM, signal.SIGINT]


def test_the_agents_poll_outlives_the_rendezvous_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first lost connection to the rendezvous store answers "no node waits" and the store is
    not asked again; other errors still raise (the process test:
    ``test_a_killed_rank_on_two_nodes_is_named_by_both``)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    answers: list[object] = [1, RendezvousConnectionError("gone"), 3]

    def ask(handler: object) -> int:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return int(answer)  # type: ignore[call-overload]

    monkeypatch.setattr(DynamicRendezvousHandler, "num_nodes_waiting", ask)
    watch = outlive_the_rendezvous_host()
    handler = SimpleNamespace()
    assert [DynamicRendezvousHandler.num_nodes_waiting(handler) for _ in range(3)] == [1, 0, 0]  # type: ignore[arg-type]
    assert answers == [3] and isinstance(watch.lost, RendezvousConnectionError)
    with pytest.raises(ValueError):
        RendezvousHostWatch().nodes_waiting(lambda: int("not a count"))


def test_each_attempt_gets_a_fresh_store_unless_the_user_chose() -> None:
    """The wrapper opts out of torchrun's shared store (the process test: test_elastic_restart.py,
    ``test_a_restart_joins_whichever_way_the_nodes_agents_count_it``); a value the user set is kept."""
    unset: dict[str, str] = {}
    fresh_store_per_attempt(unset)
    assert unset == {SHARED_STORE_OPT_OUT: "1"}
    chosen = {SHARED_STORE_OPT_OUT: "0"}
    fresh_store_per_attempt(chosen)
    assert chosen == {SHARED_STORE_OPT_OUT: "0"}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_bad_key_is_one_line_and_status_2(tmp_path: Path, launcher: str) -> None:
    job = start_launcher(tmp_path, launcher, [*FAULT_ARGS, BAD_KEY])
    try:
        job.wait_all(timeout=90)
        assert job.procs[0].returncode == 2, job.errors()
        lines = check_launcher_report(job)
        assert len([x for x in lines if x.startswith("sysx-train: error: unknown key 'parallel.pipelines'")]) == 1, (
            lines
        )
        job.check_nothing_left()
    finally:
        job.kill()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher", ["sysx.launch", "mpirun", "two_nodes"])
def test_a_rank_raising_mid_step_is_named_once(tmp_path: Path, launcher: str) -> None:
    job = start_launcher(tmp_path, launcher, FAULT_ARGS, SYSX_FAULT=f"raise@1:{FAULT_STEP}")
    try:
        job.wait_all(timeout=150)
        assert job.procs[0].returncode == 1, job.errors()
        lines = check_launcher_report(job)
        failed = [x for x in lines if x.startswith("sysx-train: rank 1: error: InjectedFault: ")]
        assert len(failed) == 1, lines
        assert (tmp_path / "run" / "traceback-rank1.txt").read_text().startswith("Traceback"), failed
        assert any("stopped because rank 1 failed" in x for x in lines), lines  # rank 0 says why it stopped
        job.check_nothing_left()
    finally:
        job.kill()


def start_two_nodes_rank_1_hosting(tmp_path: Path, args: list[str], **extra_env: str) -> Job:
    """The two "nodes" of ``launch/two_nodes_localhost.sh`` (one rank each), started so that rank
    1's agent hosts the rendezvous: on one machine the first agent to bind the endpoint hosts it,
    and the rendezvous numbers the nodes by pid, so node A starts first (the lower pid: rank 0) but
    waits, in a shell that then execs it, until node B (rank 1) listens on the port. In CI
    (bad key, two_nodes) node 1 won that race by itself. ``procs``: node A, node B."""
    job, mark = f"stop{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    env = launcher_env(job, mark, **extra_env)
    port = env["PORT"]
    torchrun = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
    node = [sys.executable, "-m", "sysx.launch", *torchrun, f"--rdzv_id=sysx-{job}", "-m", "sysx.train"]
    node += [*args, f"run_dir={tmp_path / 'run'}"]
    listening = f"until (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null; do sleep 0.1; done"
    argvs = [["bash", "-c", f'{listening}; exec "$@"', "node-a", *node], node]
    return Job(tmp_path, [spawn(argv, env, tmp_path) for argv in argvs], job, mark)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_rank_on_two_nodes_is_named_by_both(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed mid-step on its own "node", whose agent hosts the rendezvous and leaves
    with it: rank 0's agent lets rank 0 end and report (sysx.launch, ``outlive_the_rendezvous_host``)
    rather than stopping it with a line of its own (``torchrun failed: RendezvousConnectionError``,
    status 1: CI at 652a412, where the lost rendezvous turned a bad key's status 2 into 1)."""
    job = start_two_nodes_rank_1_hosting(tmp_path, FAULT_ARGS, SYSX_FAULT=f"kill@1:{FAULT_STEP}")
    try:
        deadline = time.monotonic() + 90
        while len(ranks := job.rank_pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        parents = [int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in ranks]
        assert parents == [p.pid for p in job.procs], "the premise: rank r runs under node r's agent"
        job.wait_for_step(1)
        elapsed = job.wait_all(timeout=KILL_STOP_S + 60)  # from step 1: the kill, then every rank's exit
        assert elapsed < KILL_STOP_S, job.errors()
        assert job.procs[1].returncode == 137, job.errors()
        assert check_launcher_report(job, proc=1) == ["sysx.launch: rank 1 failed: killed by SIGKILL (exit status 137)"]
        rank0 = check_launcher_report(job, proc=0)
        assert [x for x in rank0 if x.startswith("sysx-train: ") and "rank 1 died" in x], rank0
        said = [x for x in rank0 if x.startswith("sysx.launch: ")]
        assert said == [f"sysx.launch: rank 0 failed: exit status {job.procs[0].returncode}"], rank0
        assert job.procs[0].returncode not in (0, 130, 143), job.errors()
        job.check_nothing_left()
    finally:
        job.kill()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_on_two_nodes(tmp_path: Path) -> None:
    job = start_launcher(tmp_path, "two_nodes")
    try:
        job.wait_for_step(2)
        os.killpg(os.getpgid(job.procs[0].pid), signal.SIGINT)
        elapsed = job.wait_all(timeout=60)
        assert elapsed < SIGNAL_STOP_S, job.errors()
        assert job.procs[0].returncode == 130, job.errors()
        lines = check_launcher_report(job)
        # torchrun's agent of rank 0's "node" at times stops it with SIGTERM rather than relaying the
        # SIGINT (1 of 20 runs at 93eca2b, 2 of 24 later; which agent path sends it is not known):
        # rank 0 then says so, truthfully, and the launcher still exits 130
        signals = ("SIGINT", "SIGTERM")
        stopped = [x for x in lines for name in signals if x.startswith(f"sysx-train: stopped by {name} at step ")]
        assert stopped, lines
        check_stopped_summary(job, stopped[0].split()[3])
        job.check_nothing_left()
    finally:
        job.kill()
