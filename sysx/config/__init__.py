"""The configuration of a sysx job: typed schema, composition from ``conf/`` and validation.

The YAML files in ``conf/`` (``config.yaml`` + groups ``model/``, ``schedule/``, ``optim/``,
``data/``) are composed by Hydra on top of :class:`SysxConfig`, which is registered in Hydra's
ConfigStore as ``sysx_schema`` and is the first entry of ``config.yaml``'s defaults list. The schema
makes every node typed and closed: a value of the wrong type or a key that does not exist is
rejected while composing. :func:`validate` then checks ranges and choices, once: each section
checks its own fields (:mod:`~sysx.config.sections`), against the allowed values spelled in
:mod:`~sysx.config.choices`, and a key the chosen schedule would ignore is refused
(:mod:`~sysx.config.schedule_keys`). Every problem becomes a :class:`ConfigError` whose message is
one line naming the key, the value and what is allowed.

The dataclasses are also the programmatic API: ``SysxConfig(train=TrainSection(steps=5))`` is a
complete configuration for library users and tests, with the same defaults as ``conf/``. Nothing
here imports torch, so ``sysx-train --help`` stays fast.
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
