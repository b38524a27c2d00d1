"""This machine's hardware profile, measured once per machine and compute dtype and kept under
``<sysx cache>/autotune/`` (the single-GPU planner and the autotune profile read the same file)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from sysx import device as dev
from sysx.cachedir import cache_root
from sysx.machine.hardware import HardwareProfile, measure_hardware, memory_now
from sysx.machine.host_cost import measure_process_bytes

log = logging.getLogger(__name__)

# raised when what is measured or how changes, so figures of an older version are measured again;
# the file keeps the numbering and folder of the autotune profiles it was born with (caches stay valid)
# 5: pageable copy rates; 4: op_host_s and process_bytes (issue 27); older files are measured again
HARDWARE_VERSION = 5


def digest(data: dict[str, Any]) -> str:
    """A short stable hash of a JSON-able dict (for cache file names)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def machine_key(device: torch.device) -> dict[str, str]:
    """What identifies this machine for the caches: host, CPU model, GPU name, torch version."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:  # not Linux: platform's answer is the best there is
        import platform

        cpu = platform.processor()
    gpu = torch.cuda.get_device_name(device) if dev.is_cuda(device) else "none"
    return {"host": os.uname().nodename, "cpu": cpu, "gpu": gpu, "torch": torch.__version__}


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: concurrent ranks never
    read a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def hardware_path(device: torch.device, dtype: torch.dtype) -> Path:
    """Where this machine's hardware figures (copy rates, matmul rate in ``dtype``) are kept."""
    machine = digest(machine_key(device))
    name = f"hardware-v{HARDWARE_VERSION}-{machine}-{str(dtype).removeprefix('torch.')}.json"
    return cache_root() / "autotune" / name


def cached_op_host_s(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """The per-instruction host cost of this machine's cached hardware profile; 0.0 when none is
    cached (nothing is measured: every rank of a job reads the same file and gets the same figure)."""
    path = hardware_path(torch.device(device), dtype)
    try:
        return float(json.loads(path.read_text(encoding="utf-8")).get("op_host_s", 0.0))
    except (OSError, ValueError, AttributeError):
        return 0.0


def load_or_measure_hardware(
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    refresh: bool = False,
    repeats: int = 3,
) -> tuple[HardwareProfile, bool]:
    """This machine's hardware figures, measured once per machine (and compute dtype) and cached; the
    free and total memory are read again every time (they change, the rates do not). Returns
    ``(figures, reused)``; ``refresh`` measures again."""
    device = dev.default_device() if device is None else torch.device(device)
    path = hardware_path(device, dtype)
    if path.exists() and not refresh:
        try:
            cached = HardwareProfile(**json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as err:  # an older or damaged file: measure again
            log.warning("ignoring the unreadable hardware profile %s (%s)", path, err)
        else:
            now = memory_now(device)
            return dataclasses.replace(
                cached,
                device_free_bytes=now["device_free_bytes"],
                device_total_bytes=now["device_total_bytes"],
                host_free_bytes=now["host_free_bytes"],
                host_total_bytes=now["host_total_bytes"],
            ), True
    # the process figure costs a fresh interpreter (seconds): measured here, once per machine, not
    # by every measure_hardware (the runtime's lanes call that at start)
    found = dataclasses.replace(measure_hardware(device, dtype, repeats=repeats), process_bytes=measure_process_bytes())
    write_atomic(path, json.dumps(found.as_dict(), indent=1, sort_keys=True))
    return found, False
