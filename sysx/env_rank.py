"""This process's global rank, read from the launcher's environment before any process group
exists (torch-free, so that ``sysx-train --help`` and config errors stay fast)."""

from __future__ import annotations

import os


def env_rank() -> int:
    """Global rank from the launcher's environment (torchrun, MPICH/PMI, Open MPI); 0 without one."""
    for key in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0
