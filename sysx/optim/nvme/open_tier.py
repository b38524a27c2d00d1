"""Opening the NVMe tier of one process's stages: its state directory, files, engine and buffers.

:func:`open_tier` is what the pipeline's :class:`~sysx.runtime.optimizer.RankOptimizer` and the
window's :class:`~sysx.single.host.HostState` call when ``optim.offload=nvme``: it makes the rank's
:class:`~sysx.optim.nvme.files.StateDir` under ``optim.nvme_dir``, reserves every slot file up
front (a full disk is one :class:`~sysx.optim.nvme.files.DiskFull` line here, before training),
opens ``optim.nvme_engine`` and hands all of it to a :class:`~sysx.optim.nvme.tier.NvmeTier`,
whose :meth:`~sysx.optim.nvme.tier.NvmeTier.close` removes the files.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

from sysx.memory.budget import TIER_EXTRA_BUFFERS
from sysx.optim.nvme.engine import open_engine
from sysx.optim.nvme.files import StateDir
from sysx.optim.nvme.tier import NvmeTier, Pace, TierStage

# staging buffers beyond one per optimizer worker: one written behind, one read ahead (the planners'
# constant, sysx.memory.budget, so plan and runtime count one pool; a module name tests can patch)
EXTRA_BUFFERS = TIER_EXTRA_BUFFERS


class OffloadSettings(Protocol):
    """The ``optim.*`` keys of the tier (:class:`~sysx.optim.stage.OptimSettings` has them)."""

    @property
    def offload(self) -> str: ...

    @property
    def nvme_dir(self) -> str | None: ...

    @property
    def nvme_engine(self) -> str: ...


def slot_file(index: int, name: str, slot: int) -> str:
    """The file name of stage ``name`` (the ``index``-th, so names that sanitize alike stay apart),
    slot ``slot``: only ``[A-Za-z0-9_.]``."""
    return f"{index}.{re.sub(r'[^A-Za-z0-9_.]', '_', name)}.slot{slot}"


def open_tier(
    settings: OffloadSettings,
    stages: Sequence[TierStage],
    *,
    job: str,
    node: int | str,
    rank: int,
    workers: int,
    pace: Pace | None = None,
    pin: bool | None = None,
) -> NvmeTier:
    """The tier of ``stages`` in this rank's directory under ``settings.nvme_dir``, with one staging
    buffer per optimizer worker plus :data:`EXTRA_BUFFERS`."""
    if settings.offload != "nvme" or not settings.nvme_dir:
        raise ValueError(
            f"open_tier: optim.offload={settings.offload}, optim.nvme_dir={settings.nvme_dir}: "
            "set optim.offload=nvme and optim.nvme_dir"
        )
    files = StateDir(settings.nvme_dir, job=job, node=node, rank=rank)
    try:
        names = {(s.name, slot): slot_file(i, s.name, slot) for i, s in enumerate(stages) for slot in range(s.slots)}
        sizes = {names[(s.name, slot)]: s.nbytes for s in stages for slot in range(s.slots)}
        paths = files.reserve(sizes)
        engine = open_engine(settings.nvme_engine, files.path)
    except BaseException:
        files.close()
        raise
    try:
        return NvmeTier(
            stages,
            engine,
            lambda name, slot: paths[names[(name, slot)]],
            buffers=max(1, workers) + EXTRA_BUFFERS,
            pace=pace,
            pin=pin,
            closers=(engine.close, files.close),
        )
    except BaseException:
        engine.close()
        files.close()
        raise
