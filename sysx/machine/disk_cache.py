"""The disk bandwidth of ``optim.nvme_dir``, measured once per machine and drive and kept beside the
hardware profile (``<sysx cache>/autotune/disk-v1-<key>.json``).

The key is the machine's (:func:`~sysx.machine.hardware_cache.machine_key`: host, CPU, torch) plus
the drive the directory is on (its device number and file system) and the I/O engine asked for:
two directories on one drive share a figure, a second drive gets its own. The free space is read
again every time (it changes, the rates do not). The probe is :func:`sysx.optim.nvme.probe.measure_disk`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sysx.cachedir import cache_root
from sysx.machine.hardware_cache import digest, machine_key, write_atomic
from sysx.optim.nvme.cost import DiskRates

log = logging.getLogger(__name__)

DISK_VERSION = 1  # raised when what the probe measures changes: older files are measured again


def drive_key(directory: str) -> dict[str, str]:
    """What identifies the drive under ``directory``: its device number and file system type."""
    real = os.path.realpath(directory)
    st = os.stat(real)
    return {"device": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", "fs": _fs_type(real)}


def _fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (``/proc/mounts``; "" off Linux)."""
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return ""
    holding = [
        (len(mount), kind) for mount, kind in mounts if path == mount or path.startswith(mount.rstrip("/") + "/")
    ]
    return max(holding)[1] if holding else ""


def disk_path(directory: str, engine: str = "auto") -> Path:
    """Where the figures of the drive under ``directory`` (read through ``engine``) are kept."""
    key = {**machine_key(torch.device("cpu")), **drive_key(directory), "engine": engine}
    return cache_root() / "autotune" / f"disk-v{DISK_VERSION}-{digest(key)}.json"


def free_disk_bytes(directory: str) -> int:
    """Bytes an unprivileged process can still write under ``directory``."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _rates(found: dict[str, Any], free: int) -> DiskRates:
    how = f"measured: {found.get('engine', '?')}, {'O_DIRECT' if found.get('direct') else 'buffered'}"
    return DiskRates(float(found["read_Bps"]), float(found["write_Bps"]), free, how)


def _measure(directory: str, engine: str) -> dict[str, Any]:
    from sysx.optim.nvme.probe import measure_disk

    return measure_disk(directory, engine=engine).to_dict()


def load_or_measure_disk(
    directory: str,
    engine: str = "auto",
    *,
    refresh: bool = False,
    measure: Callable[[str, str], dict[str, Any]] = _measure,
) -> tuple[DiskRates, bool]:
    """The read and write rates of ``directory``'s drive, measured once (``measure(directory,
    engine)``: the probe's fields) and cached; returns ``(rates, reused)``. ``refresh`` measures again."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"optim.nvme_dir={directory} is not a directory; create it on a local NVMe drive or point the key at one"
        )
    path = disk_path(directory, engine)
    if path.exists() and not refresh:
        try:
            return _rates(json.loads(path.read_text(encoding="utf-8")), free_disk_bytes(directory)), True
        except (ValueError, KeyError, TypeError) as err:  # an older or damaged file: measure again
            log.warning("ignoring the unreadable disk profile %s (%s)", path, err)
    found = measure(directory, engine)
    write_atomic(path, json.dumps(found, indent=1, sort_keys=True))
    return _rates(found, free_disk_bytes(directory)), False
