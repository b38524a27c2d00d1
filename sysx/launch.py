"""``python -m sysx.launch [torchrun options] -m sysx.train ...``: torchrun, exiting like the job.

torchrun's own entry point logs through its agent (the ``OMP_NUM_THREADS`` box, ``failed (exitcode:
...)`` lines), reports a stopped or failed job with a traceback and a report box, and exits 1
whatever happened. The ranks already say what happened, one line each (:mod:`sysx.stopping`,
:mod:`sysx.peers`), so this wrapper runs the same launcher (``torch.distributed.run``: same options,
same agent, same signal forwarding) with the agent's logging off, and exits like the job: 130 / 143
after SIGINT / SIGTERM, else the status of the first rank that failed, with one line per failed
rank. ``launch/torchrun.sh`` and ``launch/two_nodes_localhost.sh`` use it.

Four behaviours of torchrun's agent are changed, each for a failure seen in CI: a stop signal that
reaches the agent twice stops the ranks once, with that signal (:class:`AgentSignals`); a
fixed-size job's agents count every restart alike (:func:`count_every_restart`); each restart
attempt gets a fresh store (:func:`fresh_store_per_attempt`); an agent whose rendezvous host left
lets its ranks end and report (:func:`outlive_the_rendezvous_host`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from sysx.stopping import REPEAT_GRACE_S

PROG = "sysx.launch"
# Statuses of a rank that stopped on a signal: it said so itself (or the agent stopped it because
# another rank failed first, which that rank's line tells).
STOP_STATUSES = frozenset(128 + s for s in (signal.SIGINT, signal.SIGTERM))
CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"
# torchrun's opt-out of handing every restart attempt the same store (see fresh_store_per_attempt)
SHARED_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def status_of(exitcode: int) -> int:
    """A process's exit code as a shell reports it: ``128 + n`` when signal ``n`` ended it."""
    return 128 - exitcode if exitcode < 0 else exitcode


def describe(status: int) -> str:
    """``killed by SIGKILL (exit status 137)`` or ``exit status 2``."""
    names = {int(s): s.name for s in signal.Signals}
    if status - 128 in names:
        return f"killed by {names[status - 128]} (exit status {status})"
    return f"exit status {status}"


def outcome(failures: Mapping[int, Any]) -> tuple[int, list[str]]:
    """The job's exit status and one line per failed rank, from torchrun's failures (global rank ->
    ``ProcessFailure``, in the order the agent saw them end: first the ranks that failed, then
    those it stopped). A rank that stopped on SIGINT/SIGTERM gets no line (it printed its own, or
    was stopped because of a rank that has one); when every rank stopped so, the job was stopped."""
    statuses = [(rank, status_of(int(failure.exitcode))) for rank, failure in failures.items()]
    failed = [(rank, status) for rank, status in statuses if status not in STOP_STATUSES]
    if not failed:
        return (statuses[0][1] if statuses else 1), []
    lines = [f"{PROG}: rank {rank} failed: {describe(status)}" for rank, status in sorted(failed)]
    return failed[0][1] or 1, lines


def quiet_agent() -> None:
    """Silence torchrun's agent in this process: its Python loggers (they set their own levels, so
    only disabling logging reaches them) and libtorch's C++ warnings (a multi-node agent whose
    rendezvous host left first dumps a C++ stack while it shuts down). The C++ level is read when
    libtorch loads; the ranks, started later from this process's environment, keep theirs."""
    logging.disable(logging.ERROR)
    own = os.environ.get(CPP_LOG_LEVEL)
    os.environ[CPP_LOG_LEVEL] = "ERROR"
    try:
        import torch  # noqa: F401  (loads libtorch with the level above)
    finally:
        if own is None:
            del os.environ[CPP_LOG_LEVEL]
        else:
            os.environ[CPP_LOG_LEVEL] = own


def fresh_store_per_attempt(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Give each restart attempt its own store, unless the user chose otherwise.

    With the store shared (torchrun's default since torch 2.4) every attempt's ranks meet in the
    node-0 agent's store, kept apart only by a prefix built from each node's own restart count
    (:func:`sysx.dist.store_namespace`). Those counts can differ (:func:`count_every_restart` says
    why; it makes them agree on a fixed-size job only), and then the attempt's ranks wait under two
    prefixes until they time out joining (a lost-twice restart in CI). Without sharing, the rank-0
    agent picks a fresh port at every rendezvous round and rank 0's worker hosts the store there,
    whatever the counts."""
    environ.setdefault(SHARED_STORE_OPT_OUT, "1")


class AgentSignals:
    """The agent's SIGINT/SIGTERM handler: the first stop signal raises torch's ``SignalException``
    (the agent then stops its ranks with that signal); a repeat within :data:`REPEAT_GRACE_S` is the
    same stop, and any later shutdown of the ranks sends the signal it got, not torchrun's SIGTERM.

    Why: a Ctrl-C reaches an agent twice when a script forwards it (``launch/two_nodes_localhost.sh``
    traps it for a signal sent to the script alone). torch's handler raised again on the second,
    in the middle of stopping the ranks, and the agent's ``finally`` stopped them again with SIGTERM.
    A rank that got the SIGTERM first reported the job "stopped by SIGTERM" (one CI run of
    ``test_ctrl_c_on_two_nodes``). A signal after the grace raises again: the user insists."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.first: signal.Signals | None = None
        self.first_at = 0.0

    def handler(self, signum: int, frame: FrameType | None) -> None:
        """Raise ``SignalException`` for a stop signal, once within the grace."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        now = self.clock()
        if self.first is not None and now - self.first_at < REPEAT_GRACE_S:
            return
        self.first, self.first_at = signal.Signals(signum), now
        raise SignalException(f"Process {os.getpid()} got signal: {self.first}", sigval=self.first)

    def death_signal(self, asked: signal.Signals) -> signal.Signals:
        """The signal a shutdown of the ranks sends: the stop signal this agent got, else ``asked``."""
        return self.first or asked


def install_agent_signals(signals: AgentSignals | None = None) -> AgentSignals:
    """Put :class:`AgentSignals` into torchrun's agent (this process only): the handler its process
    context installs when it starts the ranks, and the signal its shutdown sends."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api as mp_api

    signals = signals or AgentSignals()
    mp_api._terminate_process_handler = signals.handler  # looked up when the ranks start
    shutdown = LocalElasticAgent._shutdown

    def _shutdown(agent: Any, death_sig: signal.Signals = signal.SIGTERM, *args: Any, **kwargs: Any) -> None:
        shutdown(agent, signals.death_signal(death_sig), *args, **kwargs)

    LocalElasticAgent._shutdown = _shutdown  # type: ignore[method-assign, assignment]
    return signals


def count_every_restart() -> None:
    """Make each agent of a fixed-size job count a restart it did not cause, as the agent whose
    rank failed counts it, so that ``TORCHELASTIC_RESTART_COUNT`` is the job's attempt on every node.

    torchrun's agent counts a restart only when its own ranks failed. An agent whose ranks were
    still running when another node's rank failed sees a healthy group with a node waiting, and
    restarts them as a membership change, uncounted. Which one happens is a race between this
    node's ranks noticing the death and the failing node's agent re-entering the rendezvous. In a
    job of fixed size a membership change is always such a restart, so it is counted here too.
    Without it the nodes' counts could differ: ``SYSX_FAULT``'s ``#ATTEMPT`` (and the ranks' store
    prefix under plain torchrun, :func:`sysx.dist.store_namespace`) read a different attempt on
    each node. An elastic job (``--nnodes=MIN:MAX``) keeps torch's rule: a node joining is not a
    failure."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerGroup, WorkerState

    restart = SimpleElasticAgent._restart_workers

    def _restart_workers(agent: Any, worker_group: WorkerGroup) -> None:
        if worker_group.state == WorkerState.HEALTHY and agent._remaining_restarts > 0:
            agent._remaining_restarts -= 1
        restart(agent, worker_group)

    SimpleElasticAgent._restart_workers = _restart_workers  # type: ignore[method-assign]


class RendezvousHostWatch:
    """The agent's poll for nodes waiting to join, which survives the rendezvous host leaving.

    A multi-node agent asks the rendezvous, every monitor interval while its ranks run, whether a
    node waits to join. The rendezvous lives in the store of one node's agent (node 0's on a
    cluster; on one machine, whichever agent bound the port first). When that node's ranks fail,
    its agent exits and takes the store along; torch's poll on the other nodes then raised
    ``RendezvousConnectionError``, their agents stopped their ranks with SIGTERM and printed
    ``torchrun failed``, status 1, whatever the ranks would have said (CI: a bad key's status 2 came
    out 1 when rank 1's "node" hosted the rendezvous). From the first lost connection on, the poll
    answers "no node waits", as it does when a peer node leaves while the host stays: the agent
    goes on watching its own ranks, which see their peers gone (:mod:`sysx.peers`) and end with
    their own lines and statuses. A restart still needs the rendezvous and fails there."""

    def __init__(self) -> None:
        self.lost: Exception | None = None

    def nodes_waiting(self, ask: Callable[[], int]) -> int:
        """``ask()``, or 0 once the rendezvous store is gone (``ask`` is then not called again)."""
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        if self.lost is None:
            try:
                return ask()
            except RendezvousConnectionError as err:
                self.lost = err
        return 0


def outlive_the_rendezvous_host(watch: RendezvousHostWatch | None = None) -> RendezvousHostWatch:
    """Put :class:`RendezvousHostWatch` into the c10d rendezvous's ``num_nodes_waiting`` (this
    process only; the agent alone calls it)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    watch = watch or RendezvousHostWatch()
    ask = DynamicRendezvousHandler.num_nodes_waiting

    def num_nodes_waiting(handler: DynamicRendezvousHandler) -> int:
        return watch.nodes_waiting(lambda: ask(handler))

    DynamicRendezvousHandler.num_nodes_waiting = num_nodes_waiting  # type: ignore[method-assign, assignment]
    return watch


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; returns the job's exit status."""
    quiet_agent()
    fresh_store_per_attempt()
    install_agent_signals()
    outlive_the_rendezvous_host()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if ":" not in str(args.nnodes):  # a fixed number of nodes, not an elastic range
        count_every_restart()
    try:
        run(args)
    except SignalException as stop:
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        status, lines = outcome(failed.failures)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        return status
    except Exception as err:  # the agent's own failure (a rendezvous that timed out, a bad option)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"{PROG}: torchrun failed: {type(err).__name__}{': ' + first if first else ''}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
