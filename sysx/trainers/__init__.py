"""Trainers, the job layer on top of the engines: :mod:`~sysx.trainers.reference` (plain loop),
:mod:`~sysx.trainers.single` (the sliding window of :mod:`sysx.single`) and
:mod:`~sysx.trainers.pipeline` (every pipeline schedule on :mod:`sysx.runtime`), on one
:mod:`~sysx.trainers.base`; dispatched by :mod:`sysx.train`. Engines never import this package.

Each trainer module exposes ``train(cfg: SysxConfig, info: DistInfo) -> int`` (the job) and
returns one :class:`sysx.metrics.StepResult` per step from its library API.
"""

from sysx.metrics import StepResult

__all__ = ["StepResult"]
