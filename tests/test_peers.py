"""The store's host (rank 0 outside torchrun) keeps its stop news readable until the others read it:
leaving at once takes the store along, and a rank looking a moment later reports rank 0 as crashed."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from sysx import stopping
from sysx.memory import procinfo
from sysx.peers import PeerFailed, PeerWatch
from sysx.stopping import JobStopped


@pytest.fixture(autouse=True)
def _forget_the_ending() -> Iterator[None]:
    """A failure seen marks this process as ending (:func:`sysx.stopping.ending`): not the next test's."""
    yield
    stopping.reset()


class _PolledStore(dist.HashStore):
    """A store that tells when someone asks whether a rank has heard the news (the host lingering)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = threading.Event()

    def check(self, keys: list[str]) -> bool:
        if any(k.startswith("sysx/heard/") for k in keys):
            self.asked.set()
        return super().check(keys)


def _watches(world: int = 2) -> list[PeerWatch]:
    store = _PolledStore()
    return [PeerWatch(store, r, world) for r in range(world)]


def test_rank0_lingers_until_the_others_have_read_its_stop() -> None:
    host, other = _watches()
    host.store_on_rank0 = other.store_on_rank0 = True
    host.publish_stop(15)
    read_at: list[float] = []

    def read_once_rank0_waits() -> None:
        assert host.store.asked.wait(timeout=30)  # rank 0 lingers: it is asking whether rank 1 has heard
        read_at.append(time.monotonic())  # before rank 1 reads the news (and says so)
        assert isinstance(other.explain("step 3"), JobStopped)

    reader = threading.Thread(target=read_once_rank0_waits)
    reader.start()
    host.linger(timeout=30.0)
    left_at = time.monotonic()
    reader.join()
    assert read_at and read_at[0] <= left_at < read_at[0] + 30.0


def test_rank0_does_not_wait_past_its_bound_nor_without_news() -> None:
    host, _ = _watches()
    host.store_on_rank0 = True
    t0 = time.monotonic()
    host.linger(timeout=30.0)  # published nothing: leaves at once
    assert time.monotonic() - t0 < 5.0
    host.publish_stop(2)
    t0 = time.monotonic()
    host.linger(timeout=0.2)  # nobody reads: leaves at the bound
    assert 0.2 <= time.monotonic() - t0 < 5.0


class _BrokenStore:
    """The store after its host was killed: every call fails as a closed connection does."""

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")

    get = set = check


def test_a_killed_store_host_is_named_once_its_process_is_seen_gone() -> None:
    """SIGKILL closes rank 0's sockets (the store with them) a moment before ``/proc`` shows it
    dead: the survivor keeps looking for the death instead of reporting the lost store at once,
    and reports the lost store only when no death shows up within the news wait."""
    from sysx.peers import NEWS_WAIT_S, StoreLost

    watch = PeerWatch(_BrokenStore(), 1, 2)
    watch._who[0] = ("this-host", 123, 1)
    watch.host = "this-host"
    dies_at = time.monotonic() + 0.3
    watch._process_gone = lambda rank: rank == 0 and time.monotonic() >= dies_at  # type: ignore[method-assign]
    found = watch.explain("RECV_GRAD s1.1 mb1 <-r0")
    assert found is not None and not isinstance(found, StoreLost)
    assert "rank 0 died" in str(found) and found.failed_rank == 0
    watch._process_gone = lambda rank: False  # type: ignore[method-assign]  # alive (a remote launcher, say)
    t0 = time.monotonic()
    found = watch.explain("RECV_GRAD s1.1 mb1 <-r0")
    assert isinstance(found, StoreLost) and "store is unreachable" in str(found)
    assert NEWS_WAIT_S <= time.monotonic() - t0 < NEWS_WAIT_S + 5.0


def test_the_fault_hook_fires_where_its_rank_starts_its_label(monkeypatch: pytest.MonkeyPatch) -> None:
    from sysx.faults import InjectedFault

    host, other = _watches()
    monkeypatch.setenv("SYSX_FAULT", "raise@1:step 2")
    host.doing("step 2")  # another rank
    other.doing("step 1")  # another label
    with pytest.raises(InjectedFault, match="rank 1 at step 2"):
        other.doing("step 2")
    monkeypatch.setenv("SYSX_FAULT", "explode@1:step 2")
    with pytest.raises(ValueError, match="KIND@RANK:LABEL"):
        other.doing("step 3")


def test_a_fault_with_an_attempt_fires_in_that_restart_attempt_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from sysx.faults import Fault, InjectedFault, parse

    assert parse("kill@1:step 4#0, raise@3:save 9") == [Fault("kill", 1, "step 4", 0), Fault("raise", 3, "save 9")]
    _, other = _watches()
    monkeypatch.setenv("SYSX_FAULT", "raise@1:step 2#1,raise@1:save 4#0")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)  # the first attempt (0)
    other.doing("step 2")
    with pytest.raises(InjectedFault, match="rank 1 at save 4"):
        other.doing("save 4")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    other.doing("save 4")
    with pytest.raises(InjectedFault, match="rank 1 at step 2"):
        other.doing("step 2")
    monkeypatch.setenv("SYSX_FAULT", "raise@1:step 2#x")
    with pytest.raises(ValueError, match=r"KIND@RANK:LABEL\[#ATTEMPT\]"):
        other.doing("step 3")


def test_each_restart_attempt_has_its_own_keys_in_torchruns_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent store outlives a failed attempt: the next one must not read its keys (gloo's
    addresses of the dead ranks, the failure news). A store of the ranks' own is new every time."""
    from sysx.dist import store_namespace

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = store_namespace()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert first != store_namespace() == "default_pg/attempt2"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert store_namespace() == "default_pg"


def _child_as_rank(watch: PeerWatch, rank: int, seconds: float, host: str | None = None) -> subprocess.Popen:
    """A process that lives ``seconds``, published as ``rank`` (on this host unless ``host``)."""
    child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
    started = procinfo.start_time(child.pid)
    watch.store.set(f"sysx/who/{rank}", f"{host or watch.host} {child.pid} {started}")
    return child


def test_a_rank_stopped_by_a_failure_waits_for_the_failed_process_to_end() -> None:
    """Rank 0 leaves only once the failed rank has exited (and printed its own error): MPICH's
    mpiexec ends the job at the first failing exit."""
    watch, _ = _watches()
    child = _child_as_rank(watch, 1, 0.8)
    try:
        t0 = time.monotonic()
        watch.await_report(1, timeout=30.0)
        assert child.poll() is not None or not procinfo.is_alive(child.pid, procinfo.start_time(child.pid) or 0)
        assert time.monotonic() - t0 >= 0.5
    finally:
        child.kill()
        child.wait()


def test_the_wait_for_a_failed_rank_is_bounded_and_skips_what_it_cannot_see() -> None:
    watch = _watches(world=4)[0]
    long = _child_as_rank(watch, 1, 60)
    far = _child_as_rank(watch, 2, 60, host="another-host")
    try:
        t0 = time.monotonic()
        watch.await_report(1, timeout=0.3)  # still alive: gives up at the bound
        assert 0.25 <= time.monotonic() - t0 < 10.0
        t0 = time.monotonic()
        watch.await_report(2, timeout=30.0)  # on another host: nothing to watch
        watch.await_report(3, timeout=30.0)  # never announced
        assert time.monotonic() - t0 < 5.0
    finally:
        for p in (long, far):
            p.kill()
            p.wait()


def _gone_as_rank(watch: PeerWatch, rank: int) -> None:
    """A process that has ended, published as ``rank`` on this host."""
    child = _child_as_rank(watch, rank, 0)
    child.wait()


def test_the_peer_that_vanished_without_a_word_is_named_before_one_that_left_in_order() -> None:
    """torchrun SIGTERMs a killed worker's siblings: a rank on the other node then sees two peers
    gone, and names the killed one, not the lower rank that was told to stop."""
    watch = _watches(world=4)[1]
    _gone_as_rank(watch, 2)
    _gone_as_rank(watch, 3)
    watch.store.set("sysx/doing/3", "save 9")
    PeerWatch(watch.store, 2, 4).leaving("stopped by SIGTERM")
    for found in (watch.dead_peer("step 9"), watch.explain("step 9")):
        assert isinstance(found, PeerFailed) and found.failed_rank == 3, found
        assert "rank 3 died (pid" in str(found) and str(found).endswith("during save 9")
    with pytest.raises(PeerFailed, match="rank 3 died"):
        watch.check("step 9")


def test_a_peer_gone_after_leaving_in_order_is_reported_by_its_news() -> None:
    watch = _watches(world=3)[1]
    _gone_as_rank(watch, 2)
    PeerWatch(watch.store, 2, 3).publish_failure(2, "ValueError: bad batch")
    assert "rank 2 died" in str(watch.dead_peer("step 1"))  # without its word: a death
    PeerWatch(watch.store, 2, 3).leaving("failed: ValueError: bad batch")
    with pytest.raises(PeerFailed, match="stopped because rank 2 failed: ValueError: bad batch"):
        watch.check("step 1")


def test_a_signal_that_follows_a_peers_death_names_that_death() -> None:
    """torchrun SIGTERMs a lost worker's siblings: the stop line names the death, and the others
    hear it as the failure, not as a stop."""
    from sysx import peers
    from sysx.trainers import job

    store = dist.HashStore()
    watch = peers.attach(store, 0, 2)
    try:
        _gone_as_rank(watch, 1)
        store.set("sysx/doing/1", "step 4")
        stop = JobStopped(15)
        job._stopped(SimpleNamespace(step_index=4), None, stop)  # type: ignore[arg-type]
        assert re.fullmatch(
            r" at step 4, after rank 1 died \(pid \d+ is gone: killed or crashed\) during step 4", stop.where
        )
        assert store.get("sysx/failed").decode().startswith("1\trank 1 died") and not store.check(["sysx/stop"])
        PeerWatch(store, 1, 2).leaving("stopped by SIGTERM")  # had it left in order: a plain stop
        later = JobStopped(15)
        stopping.reset()
        job._stopped(SimpleNamespace(step_index=5), None, later)
        assert later.where == " at step 5"
    finally:
        peers.detach()


def test_a_rank_learns_its_peers_as_its_waits_start_so_a_killed_store_host_is_named() -> None:
    """The peers' identities sit in the store, which outside torchrun dies with rank 0: a rank
    whose waits all ended at once (never looking at the peers) must know rank 0's process anyway."""
    host, other = _watches()
    host.store_on_rank0 = other.store_on_rank0 = True
    child = _child_as_rank(host, 0, 60)  # stands in for rank 0's process
    try:
        other.announce()
        other.learn()
        assert other._who[0] == (host.host, child.pid, procinfo.start_time(child.pid))
        other.store = _BrokenStore()  # rank 0 killed: its store went with it
        child.kill()
        child.wait()
        found = other.dead_peer("RECV_GRAD s1.1 mb0 <-r0")
        assert found is not None and found.failed_rank == 0 and "rank 0 died" in str(found)
    finally:
        child.kill()
        child.wait()
