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
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_stop import JOB_ARGS, KILL_STOP_S, SIGNAL_STOP_S, check_launcher_report, check_stopped_summary, start_launcher

from sysx.launch import SHARED_STORE_OPT_OUT, AgentSignals, fresh_store_per_attempt, install_agent_signals, outcome


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


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_rank_on_two_nodes_is_named(tmp_path: Path) -> None:
    job = start_launcher(tmp_path, "two_nodes", FAULT_ARGS, SYSX_FAULT=f"kill@1:{FAULT_STEP}")
    try:
        job.wait_for_step(1)
        elapsed = job.wait_all(timeout=KILL_STOP_S + 60)  # from step 1: the kill, then every rank's exit
        assert elapsed < KILL_STOP_S, job.errors()
        assert job.procs[0].returncode not in (0, 130, 143), job.errors()
        lines = check_launcher_report(job)
        named = [
            x for x in lines if "rank 1 died" in x or x.startswith("sysx.launch: rank 1 failed: killed by SIGKILL")
        ]
        assert named, lines
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
