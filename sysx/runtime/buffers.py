"""Device-side buffers of one rank: parameter slots (current + prefetch) and gradient buffers.

:class:`ParamSlots` copies the next unit's parameters from the shared store on the H2D stream while
the compute stream works on the current one; :class:`GradBuffers` copies a sub-stage's gradients
to the host on the D2H stream for the CPU optimizer. On CPU the facade's streams and events are
no-ops and every copy is done when it returns, so the same code runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sysx import device as dev
from sysx.partition import unit_label
from sysx.trace.recorder import D2H, H2D, Recorder


class BufferError(RuntimeError):
    """The op list asked for a buffer state that does not exist (a schedule/runtime mismatch)."""


@dataclass
class Slot:
    """One parameter buffer on the device."""

    index: int
    buffer: torch.Tensor
    unit: tuple[int, int] | None = None  # (stage, sub) loaded here; sub -1 = whole forward stage
    layers: range = range(0)
    ready: dev.Event | None = None  # H2D copy done
    released: dev.Event | None = None  # compute done with the previous unit


class ParamSlots:
    """``n`` device buffers holding the parameters of loaded units (see docs/architecture.md)."""

    def __init__(
        self,
        n: int,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        layer_numels: Sequence[int],
        h2d: dev.Stream,
        compute: dev.Stream,
    ) -> None:
        if n < 1:
            raise ValueError(f"ParamSlots: n={n} must be >= 1")
        self.device = torch.device(device)
        self.slots = [Slot(i, torch.empty(numel, dtype=dtype, device=self.device)) for i in range(n)]
        # allocated on the current stream, first written by h2d: order the two once (the CUDA
        # sanitizer flagged the first load of a gpipe run on an H200 without it)
        h2d.wait_stream(dev.current_stream(self.device))
        self.offsets = [0]
        for x in layer_numels:
            self.offsets.append(self.offsets[-1] + x)
        self.h2d = h2d
        self.compute = compute
        self.recorder: Recorder | None = None  # set for a window of recorded steps (sysx.trace)

    def _find(self, unit: tuple[int, int]) -> Slot | None:
        return next((s for s in self.slots if s.unit == unit), None)

    def load(self, unit: tuple[int, int], layers: range, pieces: Sequence[torch.Tensor], label: str) -> None:
        """Start copying ``pieces`` (host tensors, concatenated) into a free slot for ``unit``."""
        if self._find(unit) is not None:
            raise BufferError(f"{label}: {unit_label(*unit)} is already loaded")
        slot = next((s for s in self.slots if s.unit is None), None)
        if slot is None:
            busy = ", ".join(f"slot {s.index}: {s.unit}" for s in self.slots)
            raise BufferError(
                f"{label}: no free parameter buffer ({busy}); the schedule's param_buffers must match the runtime's"
            )
        numel = self.offsets[layers.stop] - self.offsets[layers.start]
        if sum(p.numel() for p in pieces) != numel or numel > slot.buffer.numel():
            raise BufferError(
                f"{label}: host pieces hold {sum(p.numel() for p in pieces)} elements, the unit needs {numel} "
                f"(slot size {slot.buffer.numel()})"
            )
        if slot.released is not None:
            self.h2d.wait_event(slot.released)
        rec = self.recorder if self.recorder is not None and self.recorder.on else None
        # after the wait, before the copy's block (an emulated stream charges the copy as the block opens)
        begin = rec.mark(self.h2d) if rec is not None else None
        with self.h2d.use():
            offset = 0
            for piece in pieces:
                n = piece.numel()
                slot.buffer[offset : offset + n].copy_(piece, non_blocking=True)
                offset += n
            slot.ready = self.h2d.record_event(timing=rec is not None)
        slot.unit, slot.layers = unit, layers
        nbytes = numel * slot.buffer.element_size()
        if rec is not None and begin is not None:
            rec.add(H2D, None, begin, slot.ready, nbytes)

    def view(self, layers: range, label: str) -> torch.Tensor:
        """The flat parameters of ``layers`` inside a loaded slot; the compute stream waits for its copy."""
        for slot in self.slots:
            if slot.unit is not None and slot.layers.start <= layers.start and layers.stop <= slot.layers.stop:
                if slot.ready is not None:
                    self.compute.wait_event(slot.ready)
                lo = self.offsets[layers.start] - self.offsets[slot.layers.start]
                hi = self.offsets[layers.stop] - self.offsets[slot.layers.start]
                return slot.buffer[lo:hi]
        loaded = ", ".join(
            f"{s.unit} layers {s.layers.start}..{s.layers.stop - 1}" for s in self.slots if s.unit is not None
        )
        raise BufferError(
            f"{label}: the parameters of layers {layers.start}..{layers.stop - 1} are not loaded "
            f"(loaded: {loaded or 'nothing'}); a LOAD_PARAMS is missing"
        )

    def free(self, unit: tuple[int, int], label: str) -> None:
        """Return ``unit``'s slot once the compute stream's work so far is done."""
        slot = self._find(unit)
        if slot is None:
            raise BufferError(f"{label}: {unit_label(*unit)} is not loaded")
        slot.released = self.compute.record_event()
        slot.unit, slot.layers, slot.ready = None, range(0), None

    def loaded(self) -> list[tuple[int, int]]:
        """Units currently in a slot."""
        return [s.unit for s in self.slots if s.unit is not None]


class GradBuffers:
    """Device gradient buffers of the backward sub-stages in progress, reused from a small pool."""

    def __init__(self, dtype: torch.dtype, device: torch.device, *, compute: dev.Stream, d2h: dev.Stream) -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        self.compute = compute
        self.d2h = d2h
        self.active: dict[tuple[int, int], torch.Tensor] = {}
        self.recorder: Recorder | None = None  # set for a window of recorded steps (sysx.trace)
        self._pool: list[tuple[torch.Tensor, dev.Event | None]] = []

    def get(self, unit: tuple[int, int], numel: int) -> torch.Tensor:
        """The buffer accumulating ``unit``'s gradients (zeroed on first use this step)."""
        buf = self.active.get(unit)
        if buf is not None:
            return buf
        # a buffer whose offload is still copying would hold the compute stream until the copy ends
        # (the next sub-stage's backward behind the last one's D2H): take a copied one, else a new one
        for i, (cand, done) in enumerate(self._pool):
            if cand.numel() >= numel and (done is None or done.query()):
                self._pool.pop(i)
                buf = cand[:numel]
                break
        else:
            buf = torch.empty(numel, dtype=self.dtype, device=self.device)
        buf.zero_()
        self.active[unit] = buf
        return buf

    def offload(self, unit: tuple[int, int], host: torch.Tensor) -> dev.Event:
        """Copy ``unit``'s gradients into ``host`` on the D2H stream; returns the copy's event."""
        buf = self.active.pop(unit, None)
        if buf is None:
            raise BufferError(f"OFFLOAD {unit_label(*unit)}: no gradients were accumulated for it on this rank")
        if host.numel() != buf.numel():
            raise BufferError(
                f"OFFLOAD {unit_label(*unit)}: host buffer has {host.numel()} elements, gradients {buf.numel()}"
            )
        self.d2h.wait_stream(self.compute)
        rec = self.recorder if self.recorder is not None and self.recorder.on else None
        begin = rec.mark(self.d2h) if rec is not None else None  # after the wait, before the copy's block
        with self.d2h.use():
            host.copy_(buf, non_blocking=True)
            # an optimizer thread waits on it: sleep, do not spin
            event = self.d2h.record_event(blocking=True, timing=rec is not None)
        if rec is not None and begin is not None:
            rec.add(D2H, None, begin, event, buf.numel() * buf.element_size())
        dev.record_tensor_use(buf, self.d2h)
        base = buf if buf._base is None else buf._base
        self._pool.append((base, event))
        return event
