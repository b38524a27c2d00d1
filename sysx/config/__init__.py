"""The configuration of a sysx job: the typed schema (:class:`SysxConfig`), its composition from
``conf/`` by Hydra (:mod:`~sysx.config.compose`) and :func:`validate`, which checks every value
once and turns a problem into a one-line :class:`ConfigError` naming the key, the value and what
is allowed. The dataclasses are also the library API (``SysxConfig(train=TrainSection(steps=5))``).
"""

from __future__ import annotations

from sysx.config.checks import ConfigError
from sysx.config.compose import (
    compose_config,
    config_dir,
    from_yaml,
    group_options,
    load_config,
    register_schema,
    resolve,
    to_yaml,
)
from sysx.config.schedule_keys import refuse_ignored_keys
from sysx.config.schema import SysxConfig, model_config, validate
from sysx.config.sections import (
    CheckpointSection,
    DataSection,
    EmulateSection,
    EvalSection,
    LogSection,
    LossScaleSection,
    ModelSection,
    OptimSection,
    ProfileSection,
    ScheduleSection,
    SingleSection,
    TrainSection,
)

__all__ = [
    "CheckpointSection",
    "ConfigError",
    "DataSection",
    "EmulateSection",
    "EvalSection",
    "LogSection",
    "LossScaleSection",
    "ModelSection",
    "OptimSection",
    "ProfileSection",
    "ScheduleSection",
    "SingleSection",
    "SysxConfig",
    "TrainSection",
    "compose_config",
    "config_dir",
    "from_yaml",
    "group_options",
    "load_config",
    "model_config",
    "refuse_ignored_keys",
    "register_schema",
    "resolve",
    "to_yaml",
    "validate",
]
