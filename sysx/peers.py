"""What the ranks of a job tell each other, through the store the launcher already gives the
process group (torchrun's c10d TCPStore; under MPI the TCPStore rank 0 hosts for ``env://``):

* ``sysx/stop``: ``<signal> <rank>``, set by a rank that stops on a signal; the others stop too;
* ``sysx/failed``: ``<rank>\\t<line>``, set by the first rank that fails (or that finds a peer
  dead); the others stop with that line instead of waiting for ``schedule.timeout_s``;
* ``sysx/who/<rank>``: ``<host> <pid> <start>``, so that a rank on the same host can tell a
  SIGKILLed peer (it cannot write anything) from a slow one, from ``/proc``;
* ``sysx/doing/<rank>``: what the rank last started (``step 12``), named when it dies;
* ``sysx/left/<rank>``: why the rank is ending in order (a stop, a failure it reported): once it is
  gone it is not the death to name while a peer that vanished without a word is;
* ``sysx/attempt``: an id rank 0 draws for this attempt of the job (a torchrun restart is another).

:func:`sysx.dist.wait_for` calls :meth:`PeerWatch.check` while it waits, and after a transport
error asks :meth:`PeerWatch.explain` which peer the broken connection was.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from typing import Any

from sysx import faults, stopping
from sysx.memory import procinfo
from sysx.stopping import JobStopped

STOP_KEY, FAILED_KEY, ATTEMPT_KEY = "sysx/stop", "sysx/failed", "sysx/attempt"
STORE_POLL_S = 0.25
NEWS_WAIT_S = 3.0  # how long a broken connection may precede the news (or the death) that explains it
HEARD_KEY = "sysx/heard/{}"  # a rank read the stop or failure news
LEFT_KEY = "sysx/left/{}"  # a rank is ending in order (see the module doc)
LINGER_S = 10.0  # how long the store's host waits for the others to read its news before it exits
REPORT_S = 5.0  # how long a rank stopped by a peer's failure waits for that peer to report and exit


class PeerTimeout(RuntimeError):
    """A point-to-point operation or collective did not complete in time."""


class PeerFailed(PeerTimeout):
    """Another rank failed or died; the message names it and what it was doing."""

    def __init__(self, message: str, *, failed_rank: int, reason: str) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank
        self.reason = reason


class StoreLost(PeerFailed):
    """The job's store stopped answering: its host (rank 0, or the launcher) is gone, or going."""


class PeerWatch:
    """This rank's view of the others through the store (see the module doc)."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.host = socket.gethostname()
        self._who: dict[int, tuple[str, int, int]] = {}
        self._left_ranks: set[int] = set()
        self._store_at = 0.0
        self.published = False
        # outside torchrun the store lives in rank 0's process: no store call once it is gone
        # (a call to a dead store prints a C++ stack trace before it raises)
        self.store_on_rank0 = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"

    # ------------------------------------------------------------------------------- telling
    def announce(self) -> None:
        """Publish who this rank is (host, pid, start time)."""
        pid, started = procinfo.self_identity()
        self.store.set(f"sysx/who/{self.rank}", f"{self.host} {pid} {started}")
        self._who[self.rank] = (self.host, pid, started)
        if self.rank == 0:
            self.store.set(ATTEMPT_KEY, uuid.uuid4().hex[:8])

    def learn(self) -> None:
        """Read the identity of every peer that has announced and is not known yet (free once all
        are): a dead peer is named from them, and outside torchrun the store that holds them goes
        with rank 0. :func:`sysx.dist.wait_for` calls it as every wait starts; a wait that ends
        before its first look at the peers (a collective the ranks meet at at once) learns them too."""
        if len(self._who) < self.world and not self._store_gone():
            for rank in range(self.world):
                self._identity(rank)

    def attempt_id(self) -> str:
        """This attempt's id, the same on every rank: it keeps what an attempt writes apart from
        what a failed one left (a checkpoint's partial folder of the same step). Rank 0 publishes it
        when it joins; the wait for it is a stop or a failure's, like every wait of the job."""
        while not self.store.check([ATTEMPT_KEY]):
            stopping.raise_if_requested()
            self.check("reading the job's attempt id")
            time.sleep(0.02)
        return str(self.store.get(ATTEMPT_KEY).decode())

    def doing(self, what: str) -> None:
        """Publish what this rank starts now (named if it dies); the point where a fault asked for
        by ``SYSX_FAULT`` happens (:mod:`sysx.faults`)."""
        with contextlib.suppress(RuntimeError):
            self.store.set(f"sysx/doing/{self.rank}", what)
        faults.at(self.rank, what)

    def leaving(self, why: str) -> None:
        """Say that this rank is ending in order, on ``why``. A launcher that loses one worker
        SIGTERMs the others on its host; without the mark, a rank elsewhere that sees two peers gone
        could name the one that was told to stop instead of the one that was killed."""
        if self._store_gone():
            return
        with contextlib.suppress(RuntimeError):
            self.store.set(LEFT_KEY.format(self.rank), why)

    def publish_stop(self, signum: int) -> None:
        """Tell the others to stop: this rank got ``signum``."""
        self._publish(STOP_KEY, f"{signum} {self.rank}")

    def publish_failure(self, failed_rank: int, line: str) -> None:
        """Tell the others that ``failed_rank`` failed with ``line`` (the first report wins); this
        rank is ending on it (:func:`sysx.stopping.ending`)."""
        stopping.ending()
        self._publish(FAILED_KEY, f"{failed_rank}\t{line}")

    def linger(self, timeout: float = LINGER_S) -> None:
        """Before the store's host exits with news it published: wait until every other rank has read
        it or is gone (at most ``timeout``). Leaving at once would take the store, and the news, with
        it, and a rank looking a moment later would report rank 0 as killed or crashed."""
        if not (self.published and self.rank == 0 and self.store_on_rank0):
            return
        waiting = set(range(1, self.world))
        deadline = time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):
                waiting = {
                    r for r in waiting if not self.store.check([HEARD_KEY.format(r)]) and not self._process_gone(r)
                }
            if waiting:
                time.sleep(0.05)

    def await_report(self, rank: int, timeout: float = REPORT_S) -> None:
        """Before this rank exits on ``rank``'s failure: wait (at most ``timeout``) until that rank's
        process on this host has ended, having printed its own error line. A launcher that ends the
        job at the first failing exit (MPICH's mpiexec) killed it before it could: the job's output
        then named rank 1 only through rank 0's "stopped because rank 1 failed". A rank on another
        host cannot be watched: no wait."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            who = self._identity(rank)
            if who is None or who[0] != self.host or not procinfo.is_alive(who[1], who[2]):
                return
            time.sleep(0.05)

    def _heard(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.store.set(HEARD_KEY.format(self.rank), "1")

    def _store_gone(self) -> bool:
        return self.store_on_rank0 and self.rank != 0 and self._process_gone(0)

    def _publish(self, key: str, value: str) -> None:
        if self._store_gone():
            return
        with contextlib.suppress(RuntimeError):  # the store's host may be gone already
            if not self.store.check([key]):
                self.store.set(key, value)
                self.published = True

    # ------------------------------------------------------------------------------- hearing
    def check(self, what: str) -> None:
        """Raise :class:`JobStopped` or :class:`PeerFailed` if another rank stopped, failed or
        died (``/proc`` at every call, the store every 0.25 s)."""
        dead = self.dead_peer(what)
        if dead is not None and self.vanished(dead):
            raise _ending(dead)
        now = time.monotonic()
        if dead is not None or now - self._store_at >= STORE_POLL_S:  # one that left in order left news
            self._store_at = now
            found = self._published_news(what)
            if isinstance(found, StoreLost):  # the store's host may be dying: name it once /proc shows it
                found = self.explain(what) or found
            if found is not None:
                raise _ending(found)
        if dead is not None:
            raise _ending(dead)

    def raise_failure(self, what: str) -> None:
        """Raise :class:`PeerFailed` if another rank died or published a failure; unlike :meth:`check`,
        a stop is no reason (the ranks finish what they were writing before they stop). Any thread."""
        found = self.dead_peer(what)
        now = time.monotonic()
        if found is None and now - self._store_at >= STORE_POLL_S:
            self._store_at = now
            news = self._published_news(what)
            found = news if isinstance(news, PeerFailed) and not isinstance(news, StoreLost) else None
        if found is not None:
            raise _ending(found)

    def explain(self, what: str) -> BaseException | None:
        """After a transport error during ``what``: the stop or failure that explains it, if any.
        News first: a rank stopping on a signal may close its connections while it unwinds, before
        it publishes the stop (then exits), so the news is waited for up to :data:`NEWS_WAIT_S`.
        A dead peer without news: it may have been the store's host (rank 0 outside torchrun); a
        killed process closes its sockets before ``/proc`` shows it dead, hence the wait."""
        start = time.monotonic()
        lost: StoreLost | None = None  # a killed store host shows as a lost store before /proc shows it dead
        while True:
            dead = self.dead_peer(what)
            if dead is not None and self.vanished(dead):  # the others' news may be its echo
                return _ending(dead)
            news = self._published_news(what)
            if isinstance(news, StoreLost):
                lost, news = lost or news, None
            if news is not None:
                return _ending(news)
            if dead is not None:  # news published just before it exited, else its death
                return _ending((None if lost is not None else self._published_news(what)) or dead)
            if time.monotonic() - start >= NEWS_WAIT_S:
                return _ending(lost) if lost is not None else None
            time.sleep(0.05)

    def _published_news(self, what: str) -> BaseException | None:
        if self._store_gone():
            return None
        try:  # (check() of several keys is true only when all of them exist)
            if self.store.check([STOP_KEY]):
                signum, origin = (int(x) for x in self.store.get(STOP_KEY).decode().split())
                self._heard()
                return JobStopped(signum, origin)
            if not self.store.check([FAILED_KEY]):
                return None
            rank, _, line = self.store.get(FAILED_KEY).decode().partition("\t")
            self._heard()
        except RuntimeError as err:
            return self._store_lost(what, err)
        return PeerFailed(
            f"rank {self.rank}: {what}: stopped because rank {rank} failed: {line}", failed_rank=int(rank), reason=line
        )

    def _store_lost(self, what: str, err: Exception) -> StoreLost | None:
        if self.rank == 0:
            return None  # rank 0 hosts the store (or talks to its own launcher): not a peer's death
        line = f"the job's store is unreachable ({str(err).splitlines()[0][:120]}): rank 0 or the launcher is gone"
        return StoreLost(f"rank {self.rank}: {what}: stopped because {line}", failed_rank=0, reason=line)

    def dead_peer(self, what: str) -> PeerFailed | None:
        """A peer on this host whose process is gone (SIGKILL, a crash in C code), if any; one that
        vanished without saying it was leaving (:meth:`leaving`) before one that did."""
        gone = [r for r in range(self.world) if r != self.rank and self._process_gone(r)]
        if not gone:
            return None
        rank = next((r for r in gone if not self._left(r)), gone[0])
        who = self._who[rank]
        doing = "" if rank == 0 and self.store_on_rank0 else self._doing(rank)
        line = f"rank {rank} died (pid {who[1]} is gone: killed or crashed){f' during {doing}' if doing else ''}"
        return PeerFailed(f"rank {self.rank}: {what}: stopped because {line}", failed_rank=rank, reason=line)

    def vanished_peer(self, what: str) -> PeerFailed | None:
        """:meth:`dead_peer` when that peer :meth:`vanished`, else None."""
        dead = self.dead_peer(what)
        return dead if dead is not None and self.vanished(dead) else None

    def vanished(self, dead: PeerFailed) -> bool:
        """Whether the peer :meth:`dead_peer` found ended without saying it was leaving (killed,
        crashed): the root of whatever else the job's ranks report, a launcher's SIGTERM included."""
        return not self._left(dead.failed_rank)

    def _process_gone(self, rank: int) -> bool:
        """True when ``rank`` runs on this host and its process has ended."""
        who = self._identity(rank)
        return who is not None and who[0] == self.host and not procinfo.is_alive(who[1], who[2])

    def _identity(self, rank: int) -> tuple[str, int, int] | None:
        if rank not in self._who:
            key = f"sysx/who/{rank}"
            try:
                if not self.store.check([key]):
                    return None
                host, pid, started = self.store.get(key).decode().split()
            except RuntimeError:
                return None
            self._who[rank] = (host, int(pid), int(started))
        return self._who[rank]

    def _left(self, rank: int) -> bool:
        if rank in self._left_ranks:
            return True
        if rank == 0 and self.store_on_rank0:
            return False  # its store went with it
        with contextlib.suppress(RuntimeError):
            if self.store.check([LEFT_KEY.format(rank)]):
                self._left_ranks.add(rank)
        return rank in self._left_ranks

    def _doing(self, rank: int) -> str:
        key = f"sysx/doing/{rank}"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else ""
        except RuntimeError:
            return ""


def _ending(news: BaseException) -> BaseException:
    """``news``; a failure ends this rank (:func:`sysx.stopping.ending`), a stop is a stop."""
    if isinstance(news, PeerFailed):
        stopping.ending()
    return news


_watch: PeerWatch | None = None


def attach(store: Any, rank: int, world: int) -> PeerWatch:
    """Start watching the other ranks through ``store`` (called once the process group exists)."""
    global _watch
    _watch = PeerWatch(store, rank, world)
    _watch.announce()
    return _watch


def current() -> PeerWatch | None:
    """This process's watch, or None without a process group."""
    return _watch


def detach() -> None:
    """Stop watching (the process group is gone)."""
    global _watch
    _watch = None
