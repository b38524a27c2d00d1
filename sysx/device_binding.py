"""Which device a process drives and which collective backend it uses: one source for both.

The collective backend follows the job's *resolved* device, not the mere presence of CUDA: a
``device=cpu`` job on a GPU machine (or the CPU multi-process tests there) must talk gloo, since
NCCL only moves CUDA tensors. The GPU index comes from the launcher's local rank, and more
processes per node than GPUs is refused instead of silently doubling ranks up on one GPU.
Nothing here touches CUDA, so every rule is testable on a CPU-only machine.
"""

from __future__ import annotations

import torch

from sysx.config.choices import EMULATED_DEVICE


class DeviceBindingError(ValueError):
    """The launcher started more processes on a node than it has GPUs (or no GPU at all)."""


def device_type(device: torch.device | str) -> str:
    """``cuda`` or ``cpu`` for a device or a config value (``auto`` is cuda exactly when CUDA is
    present; ``emulated`` is cpu)."""
    if isinstance(device, str) and device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str) and device == EMULATED_DEVICE:
        return "cpu"  # an emulated GPU's tensors are CPU tensors (sysx.emulate)
    return torch.device(device).type


def backend_for(device: torch.device | str) -> str:
    """The process-group backend for a job on ``device``: ``nccl`` for CUDA, ``gloo`` otherwise."""
    return "nccl" if device_type(device) == "cuda" else "gloo"


def local_device(local_rank: int, local_world_size: int, device_count: int) -> int:
    """The GPU index of local rank ``local_rank`` among ``local_world_size`` processes on a node with
    ``device_count`` GPUs; raises :class:`DeviceBindingError` (one line) when they do not fit one per GPU."""
    if device_count < 1:
        raise DeviceBindingError("CUDA reports no GPU on this node; use device=cpu")
    if local_world_size > device_count or not 0 <= local_rank < device_count:
        raise DeviceBindingError(
            f"{max(local_world_size, local_rank + 1)} processes on this node but only {device_count} GPU(s): start at "
            f"most {device_count} per node (torchrun --nproc_per_node={device_count}, mpiexec -ppn {device_count}) "
            f"or use device=cpu"
        )
    return local_rank
