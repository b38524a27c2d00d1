"""TensorBoard event files in ``run_dir/tensorboard`` (``torch.utils.tensorboard.SummaryWriter``).

A run resumed at step ``T`` opens the same directory with ``purge_step=T``: the new event file
starts with a ``SessionLog.START`` at ``T``, and TensorBoard's readers then hide every earlier event
at a step ``>= T`` (those the interrupted run logged after its last checkpoint), so each step
appears once. A fresh run in a reused ``run_dir`` purges from step 0, hiding the old run's events.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sysx.tracking.scalars import tagged_scalars

TENSORBOARD_DIR = "tensorboard"


class TensorBoardBackend:
    """Each record's :func:`tagged_scalars` as TensorBoard scalars at its step, flushed every step."""

    def __init__(self, run_dir: Path, first_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self.where = str(self.log_dir)
        self._writer: SummaryWriter | None = SummaryWriter(log_dir=str(self.log_dir), purge_step=first_step)

    def write(self, record: Mapping[str, Any]) -> None:
        """The record's scalars at ``record["step"]``; flushed, so a crash loses no logged step."""
        if self._writer is None:
            return
        step = int(record["step"])
        for tag, value in tagged_scalars(record).items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self, *, failed: bool = False) -> None:
        """Flush and close the event file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
