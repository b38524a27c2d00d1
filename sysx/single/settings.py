"""``single.*``: the settings of the single-GPU sliding-window executor (``schedule=single``).

Every automatic choice can be pinned by hand; ``0`` / ``auto`` lets the planner decide from the
measured hardware and the model (AdaWS §3.2). The global batch is always
``train.micro_batch_size * train.micro_batches`` sequences: the planner only changes how it is cut
into chunks and rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sysx.single.act_policy import LEVEL_NAMES, parse_level

POLICIES = ("dp", "pyao", *LEVEL_NAMES)
OVERLAPS = ("auto", "backward", "forward")


@dataclass
class SingleSection:
    """Knobs of ``schedule=single`` (see ``conf/schedule/single.yaml`` for the documented defaults)."""

    device_memory_gb: float = 0.0  # hard device budget in GiB (0 = all free device memory)
    host_memory_gb: float = 0.0  # hard host budget in GiB (0 = all available host memory)
    micro_batch_size: int = 0  # sequences per chunk, the unit of compute (0 = auto)
    round_sequences: int = 0  # sequences per round X, AdaWS 3.2.2 (0 = auto); divides the global batch
    window: int = 0  # blocks resident on the device W, AdaWS 3.2.3 (0 = auto)
    policy: str = "dp"  # saved activations: dp (AdaWS DP) | pyao (IQR rule) | a fixed level name
    compress: bool = False  # int8-compress offloaded activations (PyAO 4.3)
    optimizer_overlap: str = "auto"  # auto | backward (step as grads arrive) | forward (after the norm)
    hardware: str = "measure"  # measure | a preset of sysx.single.hardware.ASSUMED (planning only)
    print_plan: bool = True  # print the plan and its reasons at start


def validate_single(s: SingleSection) -> None:
    """Raise ValueError naming the first bad ``single.*`` value and what is allowed."""
    if s.device_memory_gb < 0:
        raise ValueError(f"single.device_memory_gb={s.device_memory_gb} must be >= 0 (0 = all free device memory)")
    if s.host_memory_gb < 0:
        raise ValueError(f"single.host_memory_gb={s.host_memory_gb} must be >= 0 (0 = all available host memory)")
    for name in ("micro_batch_size", "round_sequences", "window"):
        if getattr(s, name) < 0:
            raise ValueError(f"single.{name}={getattr(s, name)} must be >= 0 (0 = automatic)")
    if s.policy not in POLICIES and not str(s.policy).isdigit():
        raise ValueError(f"single.policy={s.policy} is not valid; allowed: {', '.join(POLICIES)} or a level 0..4")
    if str(s.policy).isdigit():
        parse_level(s.policy)
    if s.optimizer_overlap not in OVERLAPS:
        raise ValueError(f"single.optimizer_overlap={s.optimizer_overlap} is not valid; allowed: {', '.join(OVERLAPS)}")
    from sysx.single.hardware import ASSUMED  # torch is imported only when settings are checked

    if s.hardware != "measure" and s.hardware not in ASSUMED:
        raise ValueError(f"single.hardware={s.hardware} is not valid; allowed: measure, {', '.join(ASSUMED)}")


def single_settings(cfg: Any) -> SingleSection:
    """The ``single`` section of a job config (defaults when the schema has none yet)."""
    section = getattr(cfg, "single", None)
    if section is None:
        return SingleSection()
    if isinstance(section, SingleSection):
        return section
    known = SingleSection.__dataclass_fields__
    return SingleSection(**{k: getattr(section, k) for k in known if hasattr(section, k)})
