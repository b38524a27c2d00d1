"""This process's rank and the job's size, read from the launcher's environment before any process
group exists (torch-free, so that ``sysx-train --help`` and config errors stay fast)."""

from __future__ import annotations

import os


def env_rank() -> int:
    """Global rank from the launcher's environment (torchrun, MPICH/PMI, Open MPI); 0 without one."""
    for key in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def env_world_size() -> int:
    """Number of processes from the launcher's environment (torchrun, MPICH/PMI, Open MPI); 1 without one."""
    for key in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if key in os.environ:
            return int(os.environ[key])
    return 1


def quiet_peer_warnings() -> None:
    """In a rank of a multi-process job, keep libtorch's warnings off stderr unless the user set
    ``TORCH_CPP_LOG_LEVEL``; call it before torch is imported (libtorch reads the level once).

    A rank reports a failure, its own or a peer's, in one line (:mod:`sysx.peers`); c10d's warning
    about the same event (the store's host died while this rank read from it, with a C++ stack)
    would bury that line. Errors still print."""
    if env_world_size() > 1:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
