"""This process's rank and the job's size, read from the launcher's environment before any process
group exists (torch-free, so that ``sysx-train --help`` and config errors stay fast), and the
environment's own mistakes (a rank outside the world, torchrun's variables without a launcher)."""

from __future__ import annotations

import os

RANK_KEYS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
SIZE_KEYS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_LAUNCH_HINT = "python -m sysx.launch --nproc_per_node=N -m sysx.train ... (or NPROC=N launch/torchrun.sh)"


def _env_int(keys: tuple[str, ...], default: int) -> tuple[str | None, int]:
    """The first of ``keys`` set and its value (``default`` when none is, or when it is not an integer:
    :func:`launcher_env_problem` names that)."""
    for key in keys:
        if key in os.environ:
            value = os.environ[key].strip()
            return key, int(value) if value.lstrip("-").isdigit() else default
    return None, default


def env_rank() -> int:
    """Global rank from the launcher's environment (torchrun, MPICH/PMI, Open MPI); 0 without one."""
    return _env_int(RANK_KEYS, 0)[1]


def env_world_size() -> int:
    """Number of processes from the launcher's environment (torchrun, MPICH/PMI, Open MPI); 1 without one."""
    return _env_int(SIZE_KEYS, 1)[1]


def launcher_env_problem() -> str | None:
    """One line naming what in the launcher's environment cannot describe a job, else None: a
    non-integer rank or size, a rank outside ``0..WORLD_SIZE-1``, or torchrun's ``RANK`` and
    ``WORLD_SIZE`` without ``MASTER_ADDR``/``MASTER_PORT`` (set by hand, no launcher). Such a
    process would otherwise wait for peers that never come."""
    for keys in (RANK_KEYS, SIZE_KEYS):
        key, _ = _env_int(keys, 0)
        if key is not None and not os.environ[key].strip().lstrip("-").isdigit():
            return f"{key}={os.environ[key]} is not valid: must be an integer (set by the launcher; unset it for one process)"
    rank_key, rank = _env_int(RANK_KEYS, 0)
    size_key, world = _env_int(SIZE_KEYS, 1)
    if world < 1:
        return f"{size_key}={world} is not valid: must be >= 1 (unset it for one process)"
    if not 0 <= rank < world:
        return (
            f"{rank_key}={rank} is outside the job: {size_key or 'WORLD_SIZE'}={world} has ranks 0..{world - 1}; "
            f"give each process a rank below {world} (a launcher does: {_LAUNCH_HINT}), or unset {rank_key} for one process"
        )
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(key)]
    if world > 1 and rank_key == "RANK" and missing:
        return (
            f"WORLD_SIZE={world} RANK={rank} without {' and '.join(missing)}: the ranks cannot find each other; "
            f"start them with a launcher: {_LAUNCH_HINT}, or unset WORLD_SIZE and RANK for one process"
        )
    return None


def quiet_peer_warnings() -> None:
    """In a rank of a multi-process job, keep libtorch's warnings off stderr unless the user set
    ``TORCH_CPP_LOG_LEVEL``; call it before torch is imported (libtorch reads the level once).

    A rank reports a failure, its own or a peer's, in one line (:mod:`sysx.peers`); c10d's warning
    about the same event (the store's host died while this rank read from it, with a C++ stack)
    would bury that line. Errors still print."""
    if env_world_size() > 1:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
