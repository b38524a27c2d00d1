"""Device-side buffers of one rank: the parameter pool and the gradient buffers.

:class:`ParamPool` copies the next unit's parameters from the shared store on the H2D stream while
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
from sysx.schedule import Op, OpKind, Schedule
from sysx.schedule.param_pool import place_loads
from sysx.trace.recorder import D2H, H2D, Recorder


class BufferError(RuntimeError):
    """The op list asked for a buffer state that does not exist (a schedule/runtime mismatch)."""


@dataclass
class Loaded:
    """A unit's parameters in the pool: ``pool[lo:hi]``."""

    layers: range
    lo: int
    hi: int
    ready: dev.Event | None = None  # H2D copy done


def load_places(schedule: Schedule, ops: Sequence[Op], layer_numels: Sequence[int]) -> tuple[dict[int, int], int]:
    """Where each LOAD_PARAMS of ``ops`` (by op index) puts its unit in the parameter pool, and the
    pool's length in elements (:func:`~sysx.schedule.param_pool.place_loads`, as the plan places them)."""
    ends = [0]
    for x in layer_numels:
        ends.append(ends[-1] + x)
    events, loads = [], []
    for i, op in enumerate(ops):
        if op.kind in (OpKind.LOAD_PARAMS, OpKind.FREE):
            r = schedule.layers(op)
            events.append((op.kind == OpKind.LOAD_PARAMS, (op.stage, op.sub), ends[r.stop] - ends[r.start]))
            if op.kind == OpKind.LOAD_PARAMS:
                loads.append(i)
    plan = place_loads(events)
    return {i: int(at) for i, at in zip(loads, plan.offsets)}, int(plan.size)


class ParamPool:
    """One device buffer of ``numel`` elements holding the parameters of the loaded units, each
    where its op list's plan puts it (:func:`load_places`). A load waits for the compute that used
    the space it overwrites (the freed units' events)."""

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        layer_numels: Sequence[int],
        h2d: dev.Stream,
        compute: dev.Stream,
    ) -> None:
        if numel < 1:
            raise ValueError(f"ParamPool: numel={numel} must be >= 1")
        self.device = torch.device(device)
        self.buffer = torch.empty(numel, dtype=dtype, device=self.device)
        # allocated on the current stream, first written by h2d: order the two once (the CUDA
        # sanitizer flagged the first load of a gpipe run on an H200 without it)
        h2d.wait_stream(dev.current_stream(self.device))
        self.offsets = [0]
        for x in layer_numels:
            self.offsets.append(self.offsets[-1] + x)
        self.h2d = h2d
        self.compute = compute
        self.units: dict[tuple[int, int], Loaded] = {}
        # freed extents whose last compute may still be running: a load over one waits for it
        self.released: list[tuple[int, int, dev.Event]] = []
        self.recorder: Recorder | None = None  # set for a window of recorded steps (sysx.trace)

    def load(self, unit: tuple[int, int], layers: range, pieces: Sequence[torch.Tensor], label: str, at: int) -> None:
        """Start copying ``pieces`` (host tensors, concatenated) into the pool at ``at`` for ``unit``."""
        if unit in self.units:
            raise BufferError(f"{label}: {unit_label(*unit)} is already loaded")
        numel = self.offsets[layers.stop] - self.offsets[layers.start]
        if sum(p.numel() for p in pieces) != numel:
            raise BufferError(
                f"{label}: host pieces hold {sum(p.numel() for p in pieces)} elements, the unit needs {numel}"
            )
        lo, hi = at, at + numel
        if lo < 0 or hi > self.buffer.numel() or any(x.lo < hi and lo < x.hi for x in self.units.values()):
            raise BufferError(
                f"{label}: {unit_label(*unit)} ({numel} elements) placed at [{lo}, {hi}) does not fit in the "
                f"parameter pool of {self.buffer.numel()} beside {self._describe()}; the places come from the op "
                "list being run (load_places), which must be the one the pool was sized for"
            )
        # every extent this load overlaps is waited for, its compute done or not, and only a waited
        # extent leaves the list (every later load is on the same h2d stream, behind this wait): the
        # CUDA sanitizer orders streams by waits alone, not by the host seeing an event done, and a
        # second H200 run of the sysx schedule under it reported a race when done extents were
        # skipped or dropped unwaited. A wait on a done event costs nothing
        for a, b, event in self.released:
            if a < hi and lo < b:
                self.h2d.wait_event(event)
        self.released = [(a, b, e) for a, b, e in self.released if not (a < hi and lo < b)]
        rec = self.recorder if self.recorder is not None and self.recorder.on else None
        # after the wait, before the copy's block (an emulated stream charges the copy as the block opens)
        begin = rec.mark(self.h2d) if rec is not None else None
        with self.h2d.use():
            offset = lo
            for piece in pieces:
                n = piece.numel()
                self.buffer[offset : offset + n].copy_(piece, non_blocking=True)
                offset += n
            ready = self.h2d.record_event(timing=rec is not None)
        self.units[unit] = Loaded(layers, lo, hi, ready)
        if rec is not None and begin is not None:
            rec.add(H2D, None, begin, ready, numel * self.buffer.element_size())

    def view(self, layers: range, label: str) -> torch.Tensor:
        """The flat parameters of ``layers`` inside a loaded unit; the compute stream waits for its copy."""
        for unit in self.units.values():
            if unit.layers.start <= layers.start and layers.stop <= unit.layers.stop:
                if unit.ready is not None:
                    self.compute.wait_event(unit.ready)
                lo = unit.lo + self.offsets[layers.start] - self.offsets[unit.layers.start]
                return self.buffer[lo : lo + self.offsets[layers.stop] - self.offsets[layers.start]]
        raise BufferError(
            f"{label}: the parameters of layers {layers.start}..{layers.stop - 1} are not loaded "
            f"(loaded: {self._describe()}); a LOAD_PARAMS is missing"
        )

    def free(self, unit: tuple[int, int], label: str) -> None:
        """Release ``unit``'s extent once the compute stream's work so far is done."""
        loaded = self.units.pop(unit, None)
        if loaded is None:
            raise BufferError(f"{label}: {unit_label(*unit)} is not loaded")
        # the extents stay disjoint (this unit's load took out every one it overlapped, and no unit
        # loaded since overlaps it), so the list holds at most as many as the pool has places
        self.released.append((loaded.lo, loaded.hi, self.compute.record_event()))

    def clear(self) -> None:
        """Release every loaded unit (after a failed op list: the next one starts from an empty pool)."""
        for unit in list(self.units):
            self.free(unit, "clear")

    def loaded(self) -> list[tuple[int, int]]:
        """Units currently in the pool."""
        return list(self.units)

    def _describe(self) -> str:
        return (
            ", ".join(
                f"{unit_label(*u)} layers {x.layers.start}..{x.layers.stop - 1} at [{x.lo}, {x.hi})"
                for u, x in self.units.items()
            )
            or "nothing"
        )


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
                if done is not None:  # done already: no stall, and the CUDA sanitizer sees the order
                    self.compute.wait_event(done)
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
