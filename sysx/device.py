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
import time
from collections.abc import Iterator

import torch

from sysx.config.choices import EMULATED_DEVICE
from sysx.device_binding import local_device


def cuda_available() -> bool:
    """True when this process can use a CUDA device."""
    return torch.cuda.is_available()


_LOCAL_RANK_KEYS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
_LOCAL_SIZE_KEYS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _env_int(keys: tuple[str, ...], default: int) -> int:
    for key in keys:
        if key in os.environ:
            return int(os.environ[key])
    return default


def default_device(local_rank: int | None = None) -> torch.device:
    """``cuda:<local GPU>`` when CUDA is present, else ``cpu``.

    Once the process group is up, :func:`sysx.dist.init` has chosen this process's GPU with
    ``torch.cuda.set_device``, and that choice is the one source (the MPI node split and the
    environment can disagree). Before that, or without a process group, the local rank comes from
    the argument or from ``LOCAL_RANK`` (torchrun) / ``MPI_LOCALRANKID`` (MPICH) /
    ``OMPI_COMM_WORLD_LOCAL_RANK`` (Open MPI), defaulting to 0; more local processes than GPUs is a
    :class:`~sysx.device_binding.DeviceBindingError`.
    """
    if not cuda_available():
        return torch.device("cpu")
    if local_rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    if local_rank is None:
        local_rank = _env_int(_LOCAL_RANK_KEYS, 0)
    local_size = _env_int(_LOCAL_SIZE_KEYS, local_rank + 1)
    return torch.device("cuda", local_device(local_rank, local_size, torch.cuda.device_count()))


def default_precision(device: torch.device | str) -> str:
    """The ``precision`` a job gets when the config leaves it unset: ``bf16`` on a GPU (fp32 matmuls
    there leave the tensor cores idle), ``fp32`` on CPU (bf16 CPU matmuls are fast, but the CPU
    embedding backward accumulates in bf16 and loses 3-8% of its gradient norm)."""
    return "bf16" if is_cuda(device) else "fp32"


def resolve_device(name: str) -> torch.device:
    """Turn a config string (``auto``, ``cpu``, ``cuda``, ``cuda:1``, ``emulated``) into a device.

    Raises ValueError naming the value when CUDA is asked for but absent.
    """
    if name == "auto":
        return default_device()
    if name == EMULATED_DEVICE:  # tensors live on the CPU; time is modelled (sysx.emulate)
        return torch.device("cpu")
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

    def __init__(self, device: torch.device, *, timing: bool = False, blocking: bool = False) -> None:
        self.device = torch.device(device)
        # blocking: a host thread that synchronizes sleeps in the driver instead of spinning a core
        self._cuda = torch.cuda.Event(enable_timing=timing, blocking=blocking) if is_cuda(self.device) else None
        self._recorded = False
        self._time = 0.0  # CPU: host monotonic time of the record (the work before it is done by then)

    def record(self, stream: Stream | None = None) -> Event:
        """Record on ``stream`` (default: the current stream). Returns self for chaining."""
        if self._cuda is not None:
            self._cuda.record(stream.raw if stream is not None else None)
        else:
            self._time = time.monotonic()
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

    def timestamp(self, base: TimeBase | None = None) -> float:
        """When the work recorded before this event completed, in host ``time.monotonic()`` seconds.

        On CPU that is the moment of :meth:`record`. On CUDA the event (created with
        ``timing=True``) is placed against ``base``, a reference event of the same device paired with
        the host time it completed at; this waits for the event, so read timestamps once, at the end
        of a window of work, never per op.
        """
        if not self._recorded:
            raise RuntimeError("Event.timestamp: the event was never recorded")
        if self._cuda is None:
            return self._time
        if base is None or base.event is None:
            raise RuntimeError("Event.timestamp on CUDA needs a TimeBase recorded on the same device before this event")
        self._cuda.synchronize()
        return base.host + base.event.elapsed_ms(self) / 1000.0


class TimeBase:
    """The origin that places device events on the host clock: on CUDA a timing event recorded on
    the idle device together with the host ``time.monotonic()`` at which it completed (the device is
    synchronized first, so the two agree to a few microseconds); on CPU just the host time."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.event: Event | None = None
        if is_cuda(self.device):
            synchronize(self.device)
            self.event = Event(self.device, timing=True).record()
            self.event.synchronize()
        self.host = time.monotonic()


class Stream:
    """A CUDA stream on a GPU; on CPU a placeholder whose operations do nothing."""

    def __init__(self, device: torch.device, *, priority: int = 0, raw: torch.cuda.Stream | None = None) -> None:
        self.device = torch.device(device)
        self.raw: torch.cuda.Stream | None
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

    def record_event(self, *, timing: bool = False, blocking: bool = False) -> Event:
        """A new event recorded on this stream (``blocking``: for events a host thread waits on)."""
        return Event(self.device, timing=timing, blocking=blocking).record(self)

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


class OpTimer:
    """Seconds per label of the work issued between :meth:`start` and :meth:`stop`.

    On CUDA a kernel launch returns before the kernel runs, so host clocks measure enqueue time and
    the compute lands on whichever later op blocks. Here each span is a pair of timing events on the
    current stream, read once at :meth:`seconds`; on CPU work is done when the call returns, so the
    monotonic clock is exact.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._cuda = is_cuda(self.device)
        self._spans: list[tuple[str, Event, Event]] = []
        self._host: dict[str, float] = {}

    def start(self) -> Event | float:
        """A start mark to hand back to :meth:`stop`."""
        if self._cuda:
            return Event(self.device, timing=True).record()
        return time.monotonic()

    def stop(self, label: str, started: Event | float) -> None:
        """Add the span since ``started`` to ``label``."""
        if isinstance(started, Event):
            self._spans.append((label, started, Event(self.device, timing=True, blocking=True).record()))
        else:
            self._host[label] = self._host.get(label, 0.0) + time.monotonic() - started

    def seconds(self) -> dict[str, float]:
        """Totals per label since the last call (on CUDA this waits for the last span's work)."""
        out, self._host = self._host, {}
        if self._spans:
            self._spans[-1][2].synchronize()
            for label, begin, end in self._spans:
                out[label] = out.get(label, 0.0) + begin.elapsed_ms(end) / 1000.0
            self._spans.clear()
        return out


def synchronize_all() -> None:
    """Wait for all work on the current GPU if this process has used CUDA (no-op otherwise): copies
    still in flight from host memory must land before that memory is unmapped, e.g. after an error."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


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


def host_rss_bytes() -> int:
    """Resident set size of this process now, in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (Linux ``ru_maxrss``)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
