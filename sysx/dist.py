"""The process group: from torchrun's environment, from MPI (mpi4py), or a single process.

One process drives one GPU (or, without GPUs, one CPU "device"). Ranks are grouped into nodes by
the launcher's local world size: torchrun sets ``LOCAL_WORLD_SIZE``/``GROUP_RANK``, MPI is asked
through a shared-memory split of ``COMM_WORLD``. MPI launchers do not set ``MASTER_ADDR``/``PORT``;
rank 0 picks them and broadcasts them through mpi4py.

Every blocking wait goes through :func:`wait_for`, which turns a stuck receive into an error that
names the rank, the operation and the peer instead of a silent hang.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sysx.placement import backend_for, local_device

DEFAULT_TIMEOUT_S = 300.0


class PeerTimeout(RuntimeError):
    """A point-to-point operation or collective did not complete in time."""


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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _mpi_rendezvous() -> None:
    """Give every MPI rank the same MASTER_ADDR/MASTER_PORT, chosen on rank 0."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    address = None
    if comm.Get_rank() == 0:
        address = (os.environ.get("MASTER_ADDR") or socket.gethostname(), int(os.environ.get("MASTER_PORT") or _free_port()))
    address = comm.bcast(address, root=0)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address[0], str(address[1])


def init(*, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "auto") -> DistInfo:
    """Join the job's process group (NCCL with GPUs, gloo without) and return this rank's place.

    A single process with no launcher gets ``DistInfo()`` and no process group.
    """
    info = detect()
    info = DistInfo(**{**info.__dict__, "timeout_s": timeout_s})
    if info.world_size == 1 or dist.is_initialized():
        return info
    if info.launcher == "mpi":
        _mpi_rendezvous()
    if backend == "auto":
        backend = backend_for(device)  # from the job's device: a device=cpu job on a GPU machine talks gloo
    if backend == "nccl":
        torch.cuda.set_device(local_device(info.local_rank, info.local_world_size, torch.cuda.device_count()))
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return info


_cpu_group: dist.ProcessGroup | None = None


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


def wait_for(work: dist.Work, *, rank: int, what: str, peer: int | None, timeout_s: float) -> None:
    """Wait for an async operation; on timeout raise :class:`PeerTimeout` naming rank, op and peer.

    A transport error well before the timeout (a peer's connection closed: it crashed or was
    killed) is reported as such, with the time it took, instead of as a timeout."""
    started = time.monotonic()
    try:
        completed = work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise PeerTimeout(_timeout_message(rank, what, peer, timeout_s, err, time.monotonic() - started)) from err
    if completed is False:
        raise PeerTimeout(_timeout_message(rank, what, peer, timeout_s, None, time.monotonic() - started))


def _timeout_message(rank: int, what: str, peer: int | None, timeout_s: float, err: Exception | None,
                     elapsed_s: float | None = None) -> str:
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


def shutdown() -> None:
    """Leave the process group (safe to call twice or without one)."""
    global _cpu_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _cpu_group = None
