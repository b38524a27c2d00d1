"""Page-locked host memory for host<->GPU copies, registered in place at its exact size.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds
every request up to a power of two (a 5 GiB stage takes 8 GiB of pinned RAM). Instead, sysx maps
exactly the bytes it needs and page-locks that range with ``cudaHostRegister`` (through
``torch.cuda.cudart()``): staging buffers here, and the shared-memory segments themselves
(``SharedParamStore(pin=True)``), so copies from ``/dev/shm`` to the GPU are direct DMA.

If registration fails (memlock limit, driver) the memory stays usable as pageable memory and a
loud warning says so and how to fix it. Without CUDA everything is a no-op with the same API.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sysx.memory.budget import fmt_bytes
from sysx.memory.views import LiveViewsError, MappedBuffer

if TYPE_CHECKING:
    import torch

CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current one
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


def _cuda_available() -> bool:
    from sysx.device import cuda_available

    return cuda_available()


def _cudart() -> Any:
    import torch

    return torch.cuda.cudart()


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last-error slot after a failed registration, so the next kernel
    launch check does not report our (handled) error. Best effort: uses the libcudart this process
    already loaded, if it is a shared library. With a statically linked CUDA runtime there is no
    such library to open (and opening another copy would clear *its* error slot, not torch's): the
    handled error can then surface at the next kernel-launch check as a stale host-memory error;
    the registration warning says so, so that such a report can be told apart."""
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
        for path in paths:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            lib.cudaGetLastError()


def _error_text(cudart: Any, code: int) -> str:
    try:
        return str(cudart.cudaGetErrorString(cudart.cudaError(code)))
    except Exception:
        return f"cudaError {code}"


class HostRegistration:
    """A host range page-locked in place; :meth:`unregister` undoes it (idempotent)."""

    def __init__(self, address: int, nbytes: int, label: str, *, owned: bool) -> None:
        self.address = address
        self.nbytes = nbytes
        self.label = label
        self._owned = owned  # False when someone else had registered the range already

    def unregister(self) -> None:
        """Unpin the range (call before it is unmapped)."""
        if not self._owned:
            return
        self._owned = False
        code = int(_cudart().cudaHostUnregister(self.address))
        if code != 0:
            _clear_cuda_error()
            warnings.warn(
                f"sysx: cudaHostUnregister of {self.label} failed: {_error_text(_cudart(), code)}",
                RuntimeWarning,
                stacklevel=2,
            )


def register_host_memory(address: int, nbytes: int, *, label: str, pin: bool | None = None) -> HostRegistration | None:
    """Page-lock ``nbytes`` at ``address`` in place. Returns None without CUDA (``pin=None``: a
    silent no-op), or after a loud warning when registration fails (the memory stays pageable).
    ``pin=True`` without CUDA also warns; ``pin=False`` does nothing."""
    if pin is False:
        return None
    if not _cuda_available():
        if pin:
            warnings.warn(
                f"sysx: pinning of {label} requested but CUDA is not available; using pageable memory",
                RuntimeWarning,
                stacklevel=2,
            )
        return None
    cudart = _cudart()
    code = int(cudart.cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_PORTABLE))
    if code == 0:
        return HostRegistration(address, nbytes, label, owned=True)
    _clear_cuda_error()
    if code == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
        return HostRegistration(address, nbytes, label, owned=False)
    warnings.warn(
        f"sysx: could not page-lock {fmt_bytes(nbytes)} of host memory for {label} "
        f"(cudaHostRegister: {_error_text(cudart, code)}); FALLING BACK TO PAGEABLE MEMORY: host<->GPU copies "
        "will be slower and will not overlap with compute. Fix: raise the locked-memory limit (`ulimit -l "
        "unlimited`, `docker run --ulimit memlock=-1`, Slurm/K8s memlock settings) or reduce pinned memory. "
        "(A later CUDA error with this same text is this handled one, left behind by a statically linked runtime.)",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


class PinnedStaging:
    """One host buffer of exactly ``nbytes``, page-locked in place when CUDA is present.

    Allocate once per direction (e.g. sized to the largest stage) and reuse it: :meth:`view`
    returns flat tensors over its start. ``pinned`` says whether registration succeeded; on CPU
    the buffer is plain memory and everything else behaves the same.
    """

    def __init__(self, nbytes: int, *, label: str = "pinned staging buffer", pin: bool | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"{label}: nbytes must be positive, got {nbytes}")
        self.nbytes = nbytes
        self.label = label
        self._buffer = MappedBuffer(mmap.mmap(-1, nbytes), label)  # anonymous, page aligned, exact size
        self._registration = register_host_memory(self._buffer.address, nbytes, label=label, pin=pin)

    @property
    def pinned(self) -> bool:
        """True when the buffer is page-locked."""
        return self._registration is not None

    @property
    def mode(self) -> str:
        """``registered`` (page-locked), ``pageable`` (CUDA present but registration failed) or ``cpu``."""
        if self._registration is not None:
            return "registered"
        return "pageable" if _cuda_available() else "cpu"

    @property
    def address(self) -> int:
        """Address of the first byte."""
        return self._buffer.address

    def view(self, dtype: Any, numel: int, *, byte_offset: int = 0) -> torch.Tensor:
        """A flat tensor of ``numel`` elements over the buffer (no copy); raises if it does not fit."""
        return self._buffer.tensor(dtype, byte_offset, numel)

    def close(self) -> None:
        """Unpin and free. Raises LiveViewsError (changing nothing) while views are alive."""
        unpin: Callable[[], None] | None = self._registration.unregister if self._registration else None
        self._buffer.close(before_unmap=unpin)
        self._registration = None

    @property
    def closed(self) -> bool:
        """True once freed."""
        return self._buffer.closed

    def __enter__(self) -> PinnedStaging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PinnedStaging({fmt_bytes(self.nbytes)}, {self.mode})"


class HostBuffers:
    """Exact-size host tensors of one owner, page-locked in place when CUDA is present.

    Each tensor is a :class:`PinnedStaging` of exactly its bytes (``torch.empty(pin_memory=True)``
    would round it up to a power of two); without CUDA, or with ``pin=False``, a plain
    ``torch.empty`` tensor. :meth:`close` unpins and frees every buffer no tensor views any more.
    """

    def __init__(self, label: str, *, pin: bool | None = None) -> None:
        self.label = label
        self.pin = _cuda_available() if pin is None else pin and _cuda_available()
        self._staging: list[PinnedStaging] = []

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat uninitialised host tensor of ``numel`` elements."""
        import torch

        if not self.pin:
            return torch.empty(numel, dtype=dtype)
        staging = PinnedStaging(numel * dtype.itemsize, label=f"{self.label} #{len(self._staging)}", pin=True)
        self._staging.append(staging)
        return staging.view(dtype, numel)

    @property
    def pinned_bytes(self) -> int:
        """Bytes held in page-locked buffers."""
        return sum(s.nbytes for s in self._staging if s.pinned)

    def close(self) -> None:
        """Free the buffers; one still viewed by a tensor stays mapped (and pinned) until the process ends."""
        kept = []
        for staging in self._staging:
            try:
                staging.close()
            except LiveViewsError:
                kept.append(staging)
        self._staging = kept
