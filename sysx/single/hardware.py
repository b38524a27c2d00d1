"""The hardware numbers the single-GPU planner needs: measured on this machine by
:mod:`sysx.machine.hardware` once and cached per machine by :mod:`sysx.machine.hardware_cache` (one
hardware profile per machine, shared with the autotuner), or assumed for planning elsewhere."""

from __future__ import annotations

import torch

from sysx.config.choices import ASSUMED_HARDWARE
from sysx.machine.hardware import GB, GiB, HardwareProfile


def machine_hardware(
    setting: str, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> HardwareProfile:
    """The figures ``single.hardware`` names: ``measure`` this machine's cached profile (measured on
    first use), ``remeasure`` measured again (and cached), else the assumed preset."""
    from sysx.machine.hardware_cache import load_or_measure_hardware

    if setting in ("measure", "remeasure"):
        return load_or_measure_hardware(device, dtype, refresh=setting == "remeasure")[0]
    return assumed_hardware(setting)


def assumed_hardware(
    preset: str = "rtx4090",
    *,
    device_memory_gib: float | None = None,
    host_memory_gib: float = 256.0,
    link_gbps: float | None = None,
    bidir_gbps: float | None = None,
    tflops: float | None = None,
    mem_gbps: float | None = None,
) -> HardwareProfile:
    """A profile from a named preset of :data:`~sysx.config.choices.ASSUMED_HARDWARE`, any figure overridden by the arguments."""
    if preset not in ASSUMED_HARDWARE:
        raise ValueError(
            f"unknown hardware preset {preset!r}; choose one of {', '.join(ASSUMED_HARDWARE)} or give the figures"
        )
    p = ASSUMED_HARDWARE[preset]
    mem = p["memory_gib"] if device_memory_gib is None else device_memory_gib
    link = (p["link_gbps"] if link_gbps is None else link_gbps) * GB
    both = (p["bidir_gbps"] if bidir_gbps is None else bidir_gbps) * GB
    return HardwareProfile(
        name=f"{preset} (assumed)",
        kind="cuda",
        h2d_bytes_per_s=link,
        d2h_bytes_per_s=link,
        bidir_bytes_per_s=min(both, link),
        matmul_flops_per_s=(p["tflops"] if tflops is None else tflops) * 1e12,
        device_mem_bytes_per_s=(p["mem_gbps"] if mem_gbps is None else mem_gbps) * GB,
        device_free_bytes=int(mem * GiB),
        device_total_bytes=int(mem * GiB),
        host_free_bytes=int(host_memory_gib * GiB),
        host_total_bytes=int(host_memory_gib * GiB),
        measured=False,
    )
