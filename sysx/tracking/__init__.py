"""Where each step's metrics go (``log.backends``): ``metrics.jsonl``, TensorBoard event files and a
Weights & Biases run, all in the run directory and all fed the same record by
:class:`sysx.metrics.RunLogger` (rank 0 only). :func:`tagged_scalars` turns a record into the
grouped tags (``train/loss``, ``perf/tokens_per_s`` ...) the dashboards show; each backend is a
small class with ``write(record)`` and ``close(failed=...)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sysx.config import LogSection
from sysx.tracking.backend import MetricsBackend
from sysx.tracking.jsonl import METRICS_FILE, JsonlBackend
from sysx.tracking.scalars import TAGS, tagged_scalars

__all__ = ["METRICS_FILE", "TAGS", "JsonlBackend", "MetricsBackend", "open_backends", "tagged_scalars"]


def open_backends(
    log: LogSection, run_dir: Path, *, first_step: int = 0, config: dict[str, Any] | None = None
) -> list[MetricsBackend]:
    """Open every backend of ``log.backends`` in ``run_dir`` for a run starting at ``first_step``
    (a resumed run continues their files and runs from there). ``config`` goes to W&B as the run's
    config. If one fails to open, those already open are closed before the error goes up."""
    opened: list[MetricsBackend] = []
    try:
        for name in log.backends:
            opened.append(_open(name, log, Path(run_dir), first_step, config))
    except BaseException:
        for backend in opened:
            backend.close(failed=True)
        raise
    return opened


def _open(name: str, log: LogSection, run_dir: Path, first_step: int, config: dict[str, Any] | None) -> MetricsBackend:
    if name == "jsonl":
        return JsonlBackend(run_dir / METRICS_FILE, first_step)
    if name == "tensorboard":
        from sysx.tracking.tensorboard_log import TensorBoardBackend

        return TensorBoardBackend(run_dir, first_step)
    if name == "wandb":
        from sysx.tracking.wandb_log import WandbBackend

        return WandbBackend(
            run_dir,
            project=log.wandb_project,
            name=log.wandb_name,
            mode=log.wandb_mode,
            first_step=first_step,
            config=config,
        )
    raise ValueError(f"unknown metrics backend {name!r}")  # LogSection.validate lets none through
