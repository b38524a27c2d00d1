"""The one mapping from a step's record (a line of ``metrics.jsonl``) to the scalars the dashboards
show: every number of the record under a grouped tag (``train/``, ``val/``, ``perf/``, ``memory/``,
``checkpoint/``, ``optim/``), bytes as GiB, flags as 0/1. TensorBoard and W&B both write exactly
these, so they show what ``metrics.jsonl`` holds."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

GIB = float(1024**3)

# record key -> (tag, divisor). A record key missing here goes under ``other/`` (the test of this
# table fails first: every key a record can carry has its tag).
TAGS: dict[str, tuple[str, float]] = {
    "loss": ("train/loss", 1.0),
    "lr": ("train/lr", 1.0),
    "grad_norm": ("train/grad_norm", 1.0),
    "skipped": ("train/skipped", 1.0),  # 1: an fp16 overflow skipped the step
    "scale": ("train/loss_scale", 1.0),
    "val_loss": ("val/loss", 1.0),
    "tokens": ("perf/tokens", 1.0),  # tokens the step trained on
    "step_time_s": ("perf/step_time_s", 1.0),
    "tokens_per_s": ("perf/tokens_per_s", 1.0),
    "tflops": ("perf/tflops", 1.0),  # per device (GPU or emulated)
    "mfu": ("perf/mfu", 1.0),  # fraction of the device's dense 16-bit peak
    "elapsed_s": ("perf/elapsed_s", 1.0),
    "peak_device_mem_bytes": ("memory/device_peak_gib", GIB),
    "peak_host_rss_bytes": ("memory/host_peak_rss_gib", GIB),
    "checkpoint_stall_s": ("checkpoint/stall_s", 1.0),
    "speculated": ("optim/speculated", 1.0),  # 1: the host optimizer stepped before validation
    "rolled_back": ("optim/rolled_back", 1.0),  # stage steps undone
    "restepped": ("optim/restepped", 1.0),  # stage steps redone with the clip coefficient
    "opt_exposed_s": ("optim/exposed_s", 1.0),  # optimizer time no compute hid
}


def tag_of(key: str) -> tuple[str, float]:
    """The tag and divisor of a record key (``other/<key>`` for one without an entry in :data:`TAGS`)."""
    return TAGS.get(key, (f"other/{key}", 1.0))


def tagged_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """``record``'s numbers under their tags, ``step`` left out (it is the x axis). ``None`` and
    non-finite numbers (a skipped step's gradient norm) are left out too: a dashboard has no null."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or value is None or not isinstance(value, (int, float)):
            continue
        number = float(value)  # bools become 0.0 / 1.0
        if math.isfinite(number):
            tag, divisor = tag_of(key)
            out[tag] = number / divisor
    return out
