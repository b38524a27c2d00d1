"""Profiles cached per machine and model shape under ``<sysx cache>/autotune/``.

The file name holds a hash of :func:`~sysx.autotune.profile.machine_key` (host, CPU model, GPU
name, torch version) and one of :func:`~sysx.autotune.profile.shape_key` (every ModelConfig field,
sequence length, dtype): a new machine or a changed shape gets a fresh profile, the same job
reuses it. The hardware figures alone (copy and matmul rates) are kept per machine in a file of their
own (:func:`load_or_measure_hardware`), which the single-device planner reads too. A cached profile that lacks a micro-batch size now asked for is measured again. The p2p
figures of the last tuned job's ranks are kept in the same file.
"""

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
from sysx.autotune import profile as prof
from sysx.autotune.hardware import HardwareProfile, measure_hardware, memory_now
from sysx.autotune.p2p import P2PFigures
from sysx.cachedir import cache_root
from sysx.model import ModelConfig

log = logging.getLogger(__name__)

# raised when what is measured or how changes, so profiles of an older profiler are measured again
PROFILE_VERSION = 3


def _digest(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def profile_path(cfg: ModelConfig, seq_len: int, dtype: torch.dtype, device: torch.device) -> Path:
    """Where the profile of this machine and model shape is kept."""
    machine = _digest(prof.machine_key(device))
    shape = _digest(prof.shape_key(cfg, seq_len, dtype))
    return cache_root() / "autotune" / f"profile-v{PROFILE_VERSION}-{machine}-{shape}.json"


def hardware_path(device: torch.device, dtype: torch.dtype) -> Path:
    """Where this machine's hardware figures (copy rates, matmul rate in ``dtype``) are kept."""
    machine = _digest(prof.machine_key(device))
    return cache_root() / "autotune" / f"hardware-v{PROFILE_VERSION}-{machine}-{str(dtype).removeprefix('torch.')}.json"


def load_or_measure_hardware(
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    refresh: bool = False,
    repeats: int = 3,
) -> tuple[HardwareProfile, bool]:
    """This machine's hardware figures, measured once per machine (and compute dtype) and cached; the
    free and total memory are read again every time (they change, the rates do not). Returns
    ``(figures, reused)``; ``refresh`` measures again. The single-device planner and the autotune
    profile both come here: one hardware profile per machine."""
    device = dev.default_device() if device is None else torch.device(device)
    path = hardware_path(device, dtype)
    if path.exists() and not refresh:
        try:
            cached = HardwareProfile(**json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as err:  # an older or damaged file: measure again
            log.warning("ignoring the unreadable hardware profile %s (%s)", path, err)
        else:
            return dataclasses.replace(cached, **memory_now(device)), True
    found = measure_hardware(device, dtype, repeats=repeats)
    _write(path, json.dumps(found.as_dict(), indent=1, sort_keys=True))
    return found, False


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)  # concurrent ranks never read a half-written file


def _save(path: Path, found: prof.MachineProfile) -> None:
    _write(path, found.to_json())


def cached_profile(
    cfg: ModelConfig, seq_len: int, dtype: torch.dtype, device: torch.device
) -> prof.MachineProfile | None:
    """The cached profile of this machine and shape, or None (none, unreadable, or another shape)."""
    path = profile_path(cfg, seq_len, dtype, device)
    if not path.exists():
        return None
    try:
        cached = prof.MachineProfile.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, TypeError, KeyError) as err:  # an older or damaged file: measure again
        log.warning("ignoring the unreadable profile %s (%s)", path, err)
        return None
    return cached if cached.shape == prof.shape_key(cfg, seq_len, dtype) else None


def load_or_measure(
    cfg: ModelConfig,
    seq_len: int,
    micro_batch_sizes: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    refresh: bool = False,
    p2p: P2PFigures | None = None,
    **measure: Any,
) -> tuple[prof.MachineProfile, bool]:
    """The cached profile when it covers ``micro_batch_sizes``, else a new measurement (saved).

    Returns ``(profile, reused)``. ``refresh`` measures even when a cached profile exists. ``p2p``:
    figures just measured between the job's ranks; they replace the profile's and are saved with it.
    """
    device = dev.default_device() if device is None else torch.device(device)
    path = profile_path(cfg, seq_len, dtype, device)
    want = {m * seq_len for m in micro_batch_sizes}
    cached = None if refresh else cached_profile(cfg, seq_len, dtype, device)
    if cached is not None and want <= cached.measured_tokens():
        if p2p is not None:
            cached = dataclasses.replace(cached, p2p=p2p)
            _save(path, cached)
        return cached, True
    hardware, _ = load_or_measure_hardware(device, dtype, refresh=refresh)
    found = prof.measure_profile(
        cfg, seq_len, micro_batch_sizes, dtype=dtype, device=device, hardware=hardware, **measure
    )
    found.p2p = p2p if p2p is not None else (cached.p2p if cached is not None else None)
    _save(path, found)
    return found, False
