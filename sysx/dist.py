"""The process group: from torchrun's environment, from MPI (mpi4py), or a single process.

One process drives one GPU (or, without GPUs, one CPU "device"). Ranks are grouped into nodes by
the launcher's local world size: torchrun sets ``LOCAL_WORLD_SIZE``/``GROUP_RANK``, MPI is asked
through a shared-memory split of ``COMM_WORLD``. MPI launchers do not set ``MASTER_ADDR``/``PORT``;
rank 0 picks them and broadcasts them through mpi4py.

Every blocking wait goes through :func:`wait_for`, which turns a stuck receive into an error that
names the rank, the operation and the peer instead of a silent hang, and which waits in short
slices so that a signal (:mod:`sysx.stopping`) or another rank's stop, failure or death
(:mod:`sysx.peers`) ends the wait within a fraction of a second.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist

from sysx import peers, rendezvous, stopping
from sysx.device_binding import backend_for, local_device
from sysx.peers import PeerFailed, PeerTimeout

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistInfo",
    "PeerFailed",
    "PeerTimeout",
    "checkpoint_group",
    "cpu_group",
    "detect",
    "group_timeout_s",
    "init",
    "process_group_timeout_s",
    "shutdown",
    "wait_for",
]

DEFAULT_TIMEOUT_S = 300.0
WAIT_SLICE_S = 0.1  # how often a waiting rank looks at signals and at the other ranks
# The process group's own timeout (NCCL's watchdog tears the process down when a collective or p2p
# kernel runs longer) is a multiple of sysx's per-wait timeout: an asynchronous checkpoint receive is
# legitimately posted long before its WAIT_CKPT, and sysx's bounded waits, which name the rank, the
# op and the peer, must always fire first.
GROUP_TIMEOUT_FACTOR = 4


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "single"  # single | torchrun | mpi
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def node_rank(self) -> int:
        """Index of this process's node (ranks are numbered node by node)."""
        return self.rank // self.local_world_size

    @property
    def num_nodes(self) -> int:
        """Number of nodes in the job."""
        return self.world_size // self.local_world_size

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that owns the run directory and the progress bar."""
        return self.rank == 0

    def node_of(self, rank: int) -> int:
        """The node that global ``rank`` runs on."""
        return rank // self.local_world_size


def _mpi_env() -> bool:
    return any(key in os.environ for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def detect() -> DistInfo:
    """Read rank, world size and node layout from the launcher's environment (no communication
    except the MPI shared-memory split that tells ranks of one node apart)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return DistInfo(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            launcher="torchrun",
        )
    if _mpi_env():
        from mpi4py import MPI

        world_comm = MPI.COMM_WORLD
        node_comm = world_comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            local_rank = node_comm.Get_rank()
            local_sizes = world_comm.allgather(node_comm.Get_size())
        finally:
            node_comm.Free()
        if len(set(local_sizes)) != 1:
            raise RuntimeError(f"sysx needs the same number of processes on every node, got {sorted(set(local_sizes))}")
        return DistInfo(
            rank=world_comm.Get_rank(),
            world_size=world_comm.Get_size(),
            local_rank=local_rank,
            local_world_size=local_sizes[0],
            launcher="mpi",
        )
    return DistInfo()


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous started right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _mpi_rendezvous() -> None:
    """Give every MPI rank the same MASTER_ADDR/MASTER_PORT, chosen on rank 0."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    address = None
    if comm.Get_rank() == 0:
        address = (
            os.environ.get("MASTER_ADDR") or socket.gethostname(),
            int(os.environ.get("MASTER_PORT") or free_port()),
        )
    address = comm.bcast(address, root=0)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address[0], str(address[1])


def process_group_timeout_s(timeout_s: float) -> float:
    """The timeout the process group is created with for a per-wait timeout of ``timeout_s``: a
    multiple of it (see ``GROUP_TIMEOUT_FACTOR``), never less than a minute more."""
    return max(GROUP_TIMEOUT_FACTOR * timeout_s, timeout_s + 60.0)


def init(*, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "auto") -> DistInfo:
    """Join the job's process group (NCCL with GPUs, gloo without) and return this rank's place.

    ``timeout_s`` bounds each of sysx's waits; the process group gets
    :func:`process_group_timeout_s` of it. A single process with no launcher gets ``DistInfo()``
    and no process group.
    """
    global _timeout_s
    info = detect()
    info = DistInfo(**{**info.__dict__, "timeout_s": timeout_s})
    _timeout_s = timeout_s
    if info.world_size == 1 or dist.is_initialized():
        return info
    if info.launcher == "mpi":
        _mpi_rendezvous()
    if backend == "auto":
        backend = backend_for(device)  # from the job's device: a device=cpu job on a GPU machine talks gloo
    if backend == "nccl":
        torch.cuda.set_device(local_device(info.local_rank, info.local_world_size, torch.cuda.device_count()))
    timeout = datetime.timedelta(seconds=process_group_timeout_s(timeout_s))
    rendezvous.join(  # interruptible, and bounded by timeout_s: a rank whose peers never come does not hang
        lambda: dist.init_process_group(
            backend=backend,
            store=_job_store(info, timeout),
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
        ),
        rank=info.rank,
        world_size=info.world_size,
        timeout_s=timeout_s,
    )
    peers.attach(dist.distributed_c10d._get_default_store(), info.rank, info.world_size)
    return info


def store_namespace() -> str:
    """The prefix of this attempt's keys in the job's store: ``default_pg`` (what torch uses), plus
    ``/attempt<N>`` when the store is torchrun's agent store, which outlives a restart.

    torchrun (c10d rendezvous, TCPStore sharing, the default since torch 2.4) hands the ranks of
    every restart attempt the same store, with no prefix per attempt. The old attempt's keys are
    still there: gloo's rendezvous of the new ranks reads the dead ranks' addresses (``Gloo
    connectFullMesh failed ... Connection refused``, or a hang until the group timeout), and the
    old failure news (``sysx/failed``) would stop the new ranks at once. ``TORCHELASTIC_RESTART_COUNT``
    names the attempt; torchrun counts it per node, so on several nodes it agrees only when every
    node's agent saw its own workers fail, which a race decides. ``python -m sysx.launch`` (and the
    launch scripts) count the other restarts too (:func:`sysx.launch.count_every_restart`) and set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: every attempt gets a fresh store and this prefix is not
    used (:func:`sysx.launch.fresh_store_per_attempt`). It remains for plain ``torchrun``."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return "default_pg"
    return f"default_pg/attempt{int(os.environ.get('TORCHELASTIC_RESTART_COUNT') or 0)}"


def _job_store(info: DistInfo, timeout: datetime.timedelta) -> dist.Store:
    """The job's store from the launcher's environment (``env://``), keys under :func:`store_namespace`."""
    store, _, _ = next(dist.rendezvous("env://", rank=info.rank, world_size=info.world_size, timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(store_namespace(), store)


_cpu_group: dist.ProcessGroup | None = None
_checkpoint_group: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None  # (the world it was made in, the group)
_timeout_s = DEFAULT_TIMEOUT_S


def group_timeout_s() -> float:
    """The per-wait timeout of the job (``schedule.timeout_s``), the bound of collective waits."""
    return _timeout_s


def checkpoint_group() -> dist.ProcessGroup | None:
    """A group over all ranks, of the main backend, for checkpoint messages only (collective: every
    rank calls it at the same point; None without a process group).

    On NCCL the operations of one communicator run in order on one stream, so an asynchronous
    checkpoint transfer between two ranks would hold back the activation and gradient messages
    posted after it; its own communicator lets them overlap, as they do on gloo."""
    global _checkpoint_group
    if not dist.is_initialized():
        return None
    world = dist.distributed_c10d._get_default_group()
    if _checkpoint_group is None or _checkpoint_group[0] is not world:  # a group of an earlier, destroyed world is void
        _checkpoint_group = (world, dist.new_group(backend=dist.get_backend()))
    return _checkpoint_group[1]


def cpu_group() -> dist.ProcessGroup | None:
    """A gloo group over all ranks for small host-side collectives (overflow flags, norms).

    With gloo as the main backend this is the default group.
    """
    global _cpu_group
    if not dist.is_initialized():
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if _cpu_group is None:
        _cpu_group = dist.new_group(backend="gloo")
    return _cpu_group


@dataclass
class _Wait:
    """``Work.wait`` of one or more works, handed to the waiter thread together (one hand-over)."""

    works: list[dist.Work]
    timeout_s: float
    done: threading.Event = field(default_factory=threading.Event)
    completed: bool | None = None
    error: RuntimeError | None = None


class _Waiter:
    """A daemon thread that blocks in ``Work.wait`` for the main thread. Gloo's point-to-point
    works cannot be polled (``is_completed`` stays False until ``wait``) and a timed-out ``wait``
    closes the connection, so the main thread waits for this thread in short slices instead."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Wait | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.in_flight = 0  # waits handed over and not finished (a stop abandons the one it interrupts)

    def submit(self, works: list[dist.Work], timeout_s: float) -> _Wait:
        """Start waiting for ``works`` (in order, ``timeout_s`` for all) on the thread; returns the handle to poll."""
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._queue, self._pid = queue.SimpleQueue(), os.getpid()
            self._thread = threading.Thread(target=self._loop, name="sysx-wait", daemon=True)
            self._thread.start()
        job = _Wait(works, timeout_s)
        self.in_flight += 1
        self._queue.put(job)
        return job

    def stop(self) -> None:
        """End the thread when it is idle (at shutdown: no thread is left behind)."""
        thread = self._thread
        if thread is None or self._pid != os.getpid() or self.in_flight > 0:
            return
        self._queue.put(None)
        thread.join(timeout=5)
        self._thread = None

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            # a Work holds its tensor (a receive into a shared-memory segment, say): no reference may stay
            # with this idle thread, or the store could not close; each is popped as it is waited for
            works, deadline, job.works = job.works, time.monotonic() + job.timeout_s, []
            try:
                job.completed = True
                while works and job.completed:
                    left = max(deadline - time.monotonic(), 1e-3)
                    job.completed = works.pop(0).wait(datetime.timedelta(seconds=left))
            except RuntimeError as err:
                job.error = err
            finally:
                works.clear()
                self.in_flight -= 1
                job.done.set()


_waiter = _Waiter()


COLLECTIVE_MIN_WAIT = datetime.timedelta(milliseconds=1)  # a zero timedelta would be torch's "no timeout"


def _wait_collective(work: dist.Work, timeout_s: float, watch: peers.PeerWatch | None, what: str) -> _Wait:
    """Wait for a collective in ``Work.wait`` slices of :data:`WAIT_SLICE_S`, looking at signals
    and at the other ranks between slices: no helper thread, and woken the moment it completes.

    A collective's timed-out ``wait`` raises and leaves the work running (unlike a point-to-point
    one's, see :class:`_Waiter`); a work that raised and reads completed either failed (a peer's
    connection closed, say) or completed right after the slice ended, and a wait without a timeout
    tells which at once. It used to be polled with ``is_completed`` and sleeps backing off from
    50 us to 1 ms, which overslept: with 2 ranks on 2 cores (tiny, 2 replicas, medians of six
    interleaved runs each) VALIDATE's all-reduce took 1.57 ms where it takes 0.98 now, the step
    end's 2.04 where it takes 1.13, and the step's serial end after its last backward 11.2 ms where
    it takes 9.6 (issue 27, twenty-third session). sysx waits here only for gloo collectives (host
    tensors: the CPU group, the replica and spread groups)."""
    job, deadline = _Wait([work], timeout_s), time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            job.completed = work.wait(max(datetime.timedelta(seconds=min(WAIT_SLICE_S, left)), COLLECTIVE_MIN_WAIT))
            return job
        except RuntimeError:
            if work.is_completed():  # it failed, or completed just after the slice timed out
                try:
                    job.completed = work.wait()  # at once: True, or what failed it raised
                except RuntimeError as err:
                    job.error = err
                return job
        if time.monotonic() >= deadline:
            job.completed = False
            return job
        stopping.raise_if_requested()
        if watch is not None:
            watch.check(what)


def posted(work: dist.Work | None, what: str) -> dist.Work:
    """The Work of an ``isend``/``irecv``: torch returns None only to a rank outside the group."""
    if work is None:
        raise RuntimeError(f"{what}: this rank is not a member of the transfer's process group")
    return work


def wait_for(
    work: dist.Work | Sequence[dist.Work],
    *,
    rank: int,
    what: str,
    peer: int | None,
    timeout_s: float,
    collective: bool = False,
) -> None:
    """Wait for an async operation (or several point-to-point ones, in order, with one hand-over to
    the waiter thread); on timeout raise :class:`PeerTimeout` naming rank, op and peer.

    While it waits, a signal raises :class:`sysx.stopping.JobStopped`, and another rank's stop,
    failure or death (:mod:`sysx.peers`) raises ``JobStopped`` or :class:`PeerFailed`. A
    transport error well before the timeout (a peer's connection closed: it crashed or was
    killed) is reported as such, naming the dead peer when it can be found, instead of as a timeout.
    ``collective=True``: ``work`` is a collective, waited for on this thread (:func:`_wait_collective`)."""
    started = time.monotonic()
    stopping.raise_if_requested()
    watch = peers.current()
    if watch is not None:
        watch.learn()
    works: list[dist.Work] = list(work) if isinstance(work, (list, tuple)) else [cast(dist.Work, work)]
    if collective:
        job = _wait_collective(works[0], timeout_s, watch, what)
    else:
        job = _waiter.submit(works, timeout_s)
        while not job.done.wait(WAIT_SLICE_S):
            stopping.raise_if_requested()
            if watch is not None:
                watch.check(what)
    elapsed = time.monotonic() - started
    if job.error is not None:
        news = watch.explain(what) if watch is not None else None
        if news is not None:
            raise news from job.error
        raise PeerTimeout(_timeout_message(rank, what, peer, timeout_s, job.error, elapsed)) from job.error
    if job.completed is False:
        raise PeerTimeout(_timeout_message(rank, what, peer, timeout_s, None, elapsed))


def _timeout_message(
    rank: int, what: str, peer: int | None, timeout_s: float, err: Exception | None, elapsed_s: float | None = None
) -> str:
    partner = f" with peer rank {peer}" if peer is not None else ""
    cause = f" ({str(err).splitlines()[0]})" if err is not None else ""
    if err is not None and elapsed_s is not None and elapsed_s < 0.9 * timeout_s:
        # the transport gave up before the timeout: the connection to a peer broke (crash, kill)
        return (
            f"rank {rank}: {what}{partner} failed after {elapsed_s:.1f} s{cause}. "
            f"The peer has probably crashed or was killed; check its log."
        )
    return (
        f"rank {rank}: {what}{partner} did not complete within {timeout_s:g} s{cause}. "
        f"The peer may have crashed or be stuck; check its log. Raise schedule.timeout_s if a step is legitimately slower."
    )


def abandoned_wait() -> bool:
    """True when a stop or failure left a wait blocked in the waiter thread. The process must
    then end with ``os._exit`` after its cleanup: tearing gloo down under a thread blocked in it
    aborts the process (``terminate called without an active exception``)."""
    return _waiter.in_flight > 0


def shutdown() -> None:
    """Leave the process group (safe to call twice or without one); with an abandoned wait the
    group is left to the end of the process (see :func:`abandoned_wait`)."""
    global _cpu_group, _checkpoint_group
    peers.detach()
    if dist.is_initialized() and not abandoned_wait():
        dist.destroy_process_group()
    _waiter.stop()
    _cpu_group = _checkpoint_group = None
