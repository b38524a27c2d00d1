"""Trainers: one per ``schedule`` name, dispatched by :mod:`sysx.train`.

Each trainer module exposes ``train(cfg: SysxConfig, info: DistInfo) -> int`` (the job) and
returns one :class:`sysx.metrics.StepResult` per step from its library API.
"""

from sysx.metrics import StepResult

__all__ = ["StepResult"]
