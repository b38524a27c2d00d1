"""The checks of ``optim.offload``, ``optim.nvme_dir`` and ``optim.nvme_engine`` (the NVMe tier of
the optimizer states, :mod:`sysx.optim.nvme`)."""

from __future__ import annotations

import os

from sysx.config.checks import check_choice, fail
from sysx.config.choices import NVME_ENGINES, OFFLOADS


def check_offload(offload: str, nvme_dir: str | None, engine: str) -> None:
    """``offload`` is host or nvme; nvme needs ``nvme_dir``, an existing directory this user may
    write in (on a local NVMe: the state files are read and written every step)."""
    check_choice("optim.offload", offload, OFFLOADS)
    check_choice("optim.nvme_engine", engine, NVME_ENGINES)
    if offload != "nvme":
        return
    if not nvme_dir:
        fail(
            "optim.nvme_dir",
            nvme_dir,
            "optim.offload=nvme needs a directory on a local NVMe, e.g. optim.nvme_dir=/nvme",
        )
    path = os.path.expanduser(str(nvme_dir))
    if not os.path.isdir(path):
        fail("optim.nvme_dir", nvme_dir, "no such directory: create it on a local NVMe (mkdir -p) or name another")
    if not os.access(path, os.W_OK | os.X_OK):
        fail("optim.nvme_dir", nvme_dir, f"user {os.getuid()} may not write in it: chmod it or name another directory")
