"""Which schedule reads which keys: a key set for a schedule that ignores it is refused.

``schedule=gpipe schedule.split=2`` would otherwise run with ``d=1`` and say nothing. "Set" means
different from the schema's default (conf/ and the dataclasses agree on the defaults). The check
needs the schedule that actually runs, so ``schedule=auto`` is checked once it is resolved (to
``single`` or ``sysx`` by the number of processes, :func:`sysx.train.train_auto`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sysx.config.checks import ConfigError
from sysx.config.choices import ONE_STAGE_PER_RANK, PIPELINE_SCHEDULES
from sysx.config.sections import ScheduleSection, SingleSection

_PIPELINES = ", ".join(PIPELINE_SCHEDULES)
_SEVERAL_STAGES = ", ".join(s for s in PIPELINE_SCHEDULES if s not in ONE_STAGE_PER_RANK)


def _set_fields(section: Any) -> list[tuple[str, Any]]:
    """``(key, value)`` of the fields of ``section`` that differ from its dataclass default."""
    default = type(section)()
    return [
        (f.name, getattr(section, f.name))
        for f in dataclasses.fields(section)
        if getattr(section, f.name) != getattr(default, f.name)
    ]


def _refuse(key: str, value: Any, schedule: str, why: str, fix: str) -> None:
    raise ConfigError(f"{key}={value} is not valid for {schedule}: {why}, so the key would be ignored; {fix}")


def refuse_ignored_keys(schedule: str, section: ScheduleSection, single: SingleSection | None = None) -> None:
    """Raise :class:`ConfigError` for the first key of ``section`` (``schedule.*``) or ``single``
    (``single.*``) that schedule ``schedule`` (a resolved name, never ``auto``) does not read."""
    pipeline_keys = [(k, v) for k, v in _set_fields(section) if k != "name"]
    if schedule in ("single", "reference"):
        for key, value in pipeline_keys:
            _refuse(
                f"schedule.{key}",
                value,
                schedule,
                "it runs one process without a pipeline",
                f"remove it or use one of {_PIPELINES}",
            )
    if schedule not in PIPELINE_SCHEDULES:
        return
    for key, value in _set_fields(single) if single is not None else []:
        _refuse(
            f"single.{key}",
            value,
            schedule,
            "single.* configures schedule=single only",
            "remove it or use schedule=single",
        )
    values = dict(pipeline_keys)
    if schedule in ONE_STAGE_PER_RANK and values.get("stages_per_rank", 1) != 1:
        _refuse(
            "schedule.stages_per_rank",
            values["stages_per_rank"],
            schedule,
            "it places one stage per rank",
            f"remove it or use schedule={_SEVERAL_STAGES} for several stages per rank",
        )
    if schedule != "sysx":
        ignored = [
            k
            for k in ("split", "cfg", "spread_last_step", "head_input_grad", "backward_parts")
            if k in values
            and not (k == "split" and values[k] == 1)
            and not (k == "backward_parts" and values[k] in (None, 1))
        ]
        for key in ignored:
            _refuse(
                f"schedule.{key}",
                values[key],
                schedule,
                f"only sysx reads schedule.{key}",
                "remove it or use schedule=sysx",
            )
    elif values.get("keep_activations"):
        _refuse(
            "schedule.keep_activations",
            True,
            schedule,
            "its backward sub-stages run on other ranks than their forwards, from sent checkpoints",
            f"remove it or use one of {', '.join(s for s in PIPELINE_SCHEDULES if s != 'sysx')}",
        )
    elif section.cfg < 3 and values.get("spread_last_step") is True:
        _refuse(
            "schedule.spread_last_step",
            True,
            f"sysx with schedule.cfg={section.cfg}",
            "only CFG3's asynchronous optimizer steps a sub-stage before the validation",
            "remove it or use schedule.cfg=3",
        )
    elif section.cfg == 0 and values.get("split", 1) != 1:
        _refuse(
            "schedule.split",
            values["split"],
            "sysx with schedule.cfg=0",
            "CFG0 runs whole-stage backwards (d=1)",
            "remove it or use schedule.cfg=1, 2 or 3",
        )
