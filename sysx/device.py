"""The device facade: ``cuda`` when present, else ``cpu``.

Every runtime talks to the accelerator through this module, so the same code runs on a GPU and on
a CPU-only machine (CI). On CPU, work issued by a thread is finished when the call returns, so
streams and events keep their API but do nothing: recording an event marks it complete, waiting
returns at once, and ``with stream.use():`` runs on the calling thread.

Semantics follow CUDA's: waiting on an event that was never recorded returns immediately. Hand an
event to another thread only *after* recording it (e.g. through a queue), never before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def cuda_available() -> bool:
    """True when this process can use a CUDA device."""
    return torch.cuda.is_available()


def default_device(local_rank: int | None = None) -> torch.device:
    """``cuda:<local rank>`` when CUDA is present, else ``cpu``.

    The local rank comes from the argument or from ``LOCAL_RANK`` (torchrun) /
    ``MPI_LOCALRANKID`` (MPICH) / ``OMPI_COMM_WORLD_LOCAL_RANK`` (Open MPI), defaulting to 0.
    """
    if not cuda_available():
        return torch.device("cpu")
    if local_rank is None:
        for key in ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
            if key in os.environ:
                local_rank = int(os.environ[key])
                break
        else:
            local_rank = 0
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def resolve_device(name: str) -> torch.device:
    """Turn a config string (``auto``, ``cpu``, ``cuda``, ``cuda:1``) into a device.

    Raises ValueError naming the value when CUDA is asked for but absent.
    """
    if name == "auto":
        return default_device()
    device = torch.device(name)
    if device.type == "cuda" and not cuda_available():
        raise ValueError(f"device={name!r} but CUDA is not available here; use device=auto or device=cpu")
    if device.type == "cuda" and device.index is None:
        return default_device()
    return device


def is_cuda(device: torch.device | str) -> bool:
    """True for a CUDA device."""
    return torch.device(device).type == "cuda"


class Event:
    """A CUDA event on a GPU; on CPU a flag that is set when recorded."""

    def __init__(self, device: torch.device, *, timing: bool = False) -> None:
        self.device = torch.device(device)
        self._cuda = torch.cuda.Event(enable_timing=timing) if is_cuda(self.device) else None
        self._recorded = False

    def record(self, stream: Stream | None = None) -> Event:
        """Record on ``stream`` (default: the current stream). Returns self for chaining."""
        if self._cuda is not None:
            self._cuda.record(stream.raw if stream is not None else None)
        self._recorded = True
        return self

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait for this event without blocking the host."""
        if self._cuda is not None:
            self._cuda.wait(stream.raw if stream is not None else None)

    def synchronize(self) -> None:
        """Block the calling thread until the recorded work is done."""
        if self._cuda is not None:
            self._cuda.synchronize()

    def query(self) -> bool:
        """True when the recorded work is done (or on CPU, once recorded)."""
        if self._cuda is not None:
            return bool(self._cuda.query())
        return self._recorded

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds between this event and ``end`` (both recorded with ``timing=True``)."""
        if self._cuda is None or end._cuda is None:
            raise RuntimeError("elapsed_ms needs CUDA events created with timing=True")
        return float(self._cuda.elapsed_time(end._cuda))


class Stream:
    """A CUDA stream on a GPU; on CPU a placeholder whose operations do nothing."""

    def __init__(self, device: torch.device, *, priority: int = 0, raw: torch.cuda.Stream | None = None) -> None:
        self.device = torch.device(device)
        if raw is not None:
            self.raw = raw
        elif is_cuda(self.device):
            self.raw = torch.cuda.Stream(device=self.device, priority=priority)
        else:
            self.raw = None

    @contextlib.contextmanager
    def use(self) -> Iterator[Stream]:
        """Issue the work of the ``with`` block on this stream."""
        if self.raw is None:
            yield self
        else:
            with torch.cuda.stream(self.raw):
                yield self

    def wait_event(self, event: Event) -> None:
        """Order this stream after ``event``."""
        event.wait(self)

    def wait_stream(self, other: Stream) -> None:
        """Order this stream after all work queued so far on ``other``."""
        if self.raw is not None and other.raw is not None:
            self.raw.wait_stream(other.raw)

    def record_event(self, *, timing: bool = False) -> Event:
        """A new event recorded on this stream."""
        return Event(self.device, timing=timing).record(self)

    def synchronize(self) -> None:
        """Block until all work on this stream is done."""
        if self.raw is not None:
            self.raw.synchronize()


def new_stream(device: torch.device, *, priority: int = 0) -> Stream:
    """A fresh side stream (copies, prefetch), or a no-op stream on CPU."""
    return Stream(device, priority=priority)


def current_stream(device: torch.device) -> Stream:
    """The stream that work is issued on right now."""
    if is_cuda(device):
        return Stream(device, raw=torch.cuda.current_stream(torch.device(device)))
    return Stream(device)


def synchronize(device: torch.device) -> None:
    """Wait for all work on ``device``."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def record_tensor_use(tensor: torch.Tensor, stream: Stream) -> None:
    """Tell the caching allocator that ``tensor`` is used on ``stream`` (no-op on CPU)."""
    if stream.raw is not None and tensor.is_cuda:
        tensor.record_stream(stream.raw)


def memory_allocated(device: torch.device) -> int:
    """Bytes currently allocated by tensors on ``device`` (0 on CPU: see host memory instead)."""
    return torch.cuda.memory_allocated(device) if is_cuda(device) else 0


def max_memory_allocated(device: torch.device) -> int:
    """Peak bytes allocated on ``device`` since the last reset (0 on CPU)."""
    return torch.cuda.max_memory_allocated(device) if is_cuda(device) else 0


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window."""
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (Linux ``ru_maxrss``)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
