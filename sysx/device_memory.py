"""What a device budget caps and what it must be checked against.

``torch.cuda.set_per_process_memory_fraction`` caps the caching allocator's *reserved* memory, so
checking ``max_memory_allocated`` against a budget says too little; the CUDA context and lazily
loaded kernels count outside both, and only NVML sees them. :class:`MemoryCap` applies a budget and
puts the previous fraction back when closed (a cap must not leak into the next trainer or test);
:func:`device_usage` and :func:`over_budget` give the figures and the verdict.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sysx.device import is_cuda

GiB = 1024**3


class MemoryCap:
    """Cap this process's caching allocator on ``device`` at ``budget_bytes``; :meth:`close` restores
    the fraction that was in force before. A no-op on CPU or without a budget."""

    def __init__(self, device: torch.device | str, budget_bytes: int | None) -> None:
        self.device = torch.device(device)
        self._previous: float | None = None
        if not is_cuda(self.device) or not budget_bytes:
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
        self._previous = float(getter(self.device)) if getter is not None else 1.0
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), self.device)

    @property
    def active(self) -> bool:
        """True while the cap is applied."""
        return self._previous is not None

    def close(self) -> None:
        """Restore the previous fraction (safe to call twice)."""
        if self._previous is not None:
            torch.cuda.set_per_process_memory_fraction(self._previous, self.device)
            self._previous = None


@dataclass(frozen=True)
class DeviceUsage:
    """Device memory figures in bytes; an NVML figure is None where NVML cannot be read."""

    peak_allocated: int
    peak_reserved: int
    process_nvml: int | None  # this process's usage as the driver sees it (context and kernels included)
    device_nvml: int | None  # every process on the device
    free: int
    total: int

    def describe(self) -> str:
        """One line in GiB."""

        def g(v: int | None) -> str:
            return "n/a" if v is None else f"{v / GiB:.2f}"

        return (
            f"peak allocated {g(self.peak_allocated)} GiB, peak reserved {g(self.peak_reserved)} GiB, NVML process "
            f"{g(self.process_nvml)} GiB, NVML device {g(self.device_nvml)} GiB, free {g(self.free)} of {g(self.total)} GiB"
        )


def _process_nvml(device: torch.device) -> int | None:
    """This process's device memory from NVML (pynvml), None when NVML or the process entry is missing
    (e.g. a container whose PID namespace hides it)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:
        return None
    return None


def device_usage(device: torch.device | str) -> DeviceUsage | None:
    """The figures of :class:`DeviceUsage` on a CUDA ``device`` (None on CPU)."""
    device = torch.device(device)
    if not is_cuda(device):
        return None
    free, total = torch.cuda.mem_get_info(device)
    try:
        device_nvml: int | None = int(torch.cuda.device_memory_used(device))
    except Exception:
        device_nvml = None
    return DeviceUsage(
        int(torch.cuda.max_memory_allocated(device)),
        int(torch.cuda.max_memory_reserved(device)),
        _process_nvml(device),
        device_nvml,
        int(free),
        int(total),
    )


def over_budget(usage: DeviceUsage, budget_bytes: int) -> list[str]:
    """What exceeds ``budget_bytes``: the peak reserved memory (what the cap limits) and this process's
    NVML usage (what the GPU really gives up); empty when both fit."""
    out = []
    if usage.peak_reserved > budget_bytes:
        out.append(f"peak reserved {usage.peak_reserved / GiB:.2f} GiB > budget {budget_bytes / GiB:.2f} GiB")
    if usage.process_nvml is not None and usage.process_nvml > budget_bytes:
        out.append(
            f"NVML process usage {usage.process_nvml / GiB:.2f} GiB > budget {budget_bytes / GiB:.2f} GiB "
            f"(includes the CUDA context and loaded kernels)"
        )
    return out
