"""Ring buffers carved from one preallocated device buffer, with per-slot events (AdaWS §3.1, appendix A).

:class:`DeviceArena` allocates the whole working set once and hands out named regions (the weight,
gradient and activation rings, the transition table, the static buffers), so the device budget holds
by construction. :class:`Ring` enforces the paper's ``produce``/``consume`` slot protocol with events
between streams, its state machine checked on the host (on CPU too).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from sysx import device as dev

ALIGN = 512  # byte alignment of arena regions and ring slots


def align(n: int) -> int:
    """``n`` rounded up to the arena alignment."""
    return (int(n) + ALIGN - 1) // ALIGN * ALIGN


class RingError(RuntimeError):
    """The slot protocol was broken (a schedule bug): names the ring, slot and keys involved."""


class DeviceArena:
    """One device allocation split into named, aligned byte regions."""

    def __init__(self, device: torch.device, sizes: dict[str, int]) -> None:
        self.device = torch.device(device)
        self.offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name, size in sizes.items():
            self.offsets[name] = (off, int(size))
            off += align(size)
        self.nbytes = off
        self.buffer = torch.empty(max(off, 1), dtype=torch.uint8, device=self.device)

    def region(self, name: str) -> torch.Tensor:
        """The uint8 bytes of region ``name``."""
        if name not in self.offsets:
            raise KeyError(f"DeviceArena has no region {name!r}; regions: {', '.join(self.offsets)}")
        off, size = self.offsets[name]
        return alias(self.buffer[off : off + size])

    def describe(self) -> dict[str, int]:
        """Bytes of every region (aligned), for the memory report."""
        return {name: align(size) for name, (_, size) in self.offsets.items()}


def alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory as ``t`` with its *own* autograd version counter.

    Views share their base's version counter, so a gradient accumulated into one region of the
    arena would look like an in-place change of weights or saved activations living in another
    region, and autograd would refuse to backpropagate. Every region and every ring slot is such
    an alias: the rings' events, not version counters, order writes against reads.
    """
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    return out


def typed(raw: torch.Tensor, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
    """A 1-D ``dtype`` view of the uint8 bytes ``raw`` (its first ``numel`` elements)."""
    t = raw.view(dtype)
    return t if numel is None else t[:numel]


@dataclass
class _Slot:
    raw: torch.Tensor
    state: str = "free"  # free | ready | in_use
    key: Hashable | None = None
    ready: dev.Event | None = None
    released: dev.Event | None = None


class Ring:
    """``slots`` equal byte slots of ``slot_bytes`` each, cut from ``region`` (see docs/architecture.mdstring)."""

    def __init__(
        self,
        name: str,
        region: torch.Tensor,
        slots: int,
        slot_bytes: int,
        log: list[tuple[str, str, int, Hashable]] | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"ring {name}: needs at least 1 slot, got {slots}")
        stride = align(slot_bytes)
        if region.numel() < stride * slots - (stride - slot_bytes):
            raise ValueError(
                f"ring {name}: region of {region.numel()} bytes cannot hold {slots} slots of {slot_bytes} bytes"
            )
        self.name = name
        self.slot_bytes = int(slot_bytes)
        self._slots = [_Slot(alias(region[i * stride : i * stride + slot_bytes])) for i in range(slots)]
        self.log = log  # when a list: (ring, op, slot, key) of every fill/acquire/release, in issue order

    def __len__(self) -> int:
        return len(self._slots)

    def slot_of(self, seq: int) -> int:
        """The slot a sequence number maps to (round-robin)."""
        return seq % len(self._slots)

    def raw(self, i: int) -> torch.Tensor:
        """The bytes of slot ``i`` regardless of state: for binding long-lived views (e.g. a layer's
        parameters to its weight slot), never for reading or writing data."""
        return self._slots[i].raw

    def key(self, i: int) -> Hashable | None:
        """What slot ``i`` holds (or last held)."""
        return self._slots[i].key

    def state(self, i: int) -> str:
        """``free``, ``ready`` or ``in_use``."""
        return self._slots[i].state

    def fill(self, i: int, key: Hashable, stream: dev.Stream, write: Callable[[torch.Tensor], object]) -> None:
        """Producer: after the slot's last consumer finished, run ``write(slot)`` on ``stream`` and mark it ready."""
        s = self._slots[i]
        if s.state != "free":
            raise RingError(
                f"ring {self.name}: slot {i} refilled with {key!r} while it is {s.state} holding {s.key!r}; "
                f"a slot must be released by its consumer before it is refilled"
            )
        if s.released is not None:
            stream.wait_event(s.released)
        with stream.use():
            write(s.raw)
        s.ready = stream.record_event()
        s.state, s.key = "ready", key
        self._note("fill", i, key)

    def acquire(self, i: int, key: Hashable, stream: dev.Stream) -> torch.Tensor:
        """Consumer: wait (on ``stream``) until slot ``i`` holding ``key`` has landed, and return its bytes."""
        s = self._slots[i]
        if s.state != "ready" or s.key != key:
            raise RingError(
                f"ring {self.name}: slot {i} asked for {key!r} but it is {s.state} holding {s.key!r}; "
                f"it must be filled with that key first"
            )
        if s.ready is not None:
            stream.wait_event(s.ready)
        s.state = "in_use"
        self._note("acquire", i, key)
        return s.raw

    def release(self, i: int, stream: dev.Stream, *, keep: bool = False) -> dev.Event:
        """Consumer done: record the event producers wait for. ``keep`` leaves the data readable (ready)
        for a later acquire of the same key (e.g. the last window's weights used again by backward)."""
        s = self._slots[i]
        if s.state != "in_use":
            raise RingError(f"ring {self.name}: slot {i} released while {s.state} (holding {s.key!r})")
        s.released = stream.record_event(blocking=True)  # optimizer threads wait on grad-ring releases
        s.state = "ready" if keep else "free"
        if keep:
            s.ready = s.released
        self._note("release", i, s.key)
        return s.released

    def _note(self, op: str, i: int, key: Hashable) -> None:
        if self.log is not None:
            self.log.append((self.name, op, i, key))

    def refresh(self, i: int, key: Hashable) -> None:
        """Relabel a ready slot (its bytes are valid for ``key`` too; used when data stays in place)."""
        s = self._slots[i]
        if s.state != "ready":
            raise RingError(f"ring {self.name}: slot {i} relabelled while {s.state}")
        s.key = key

    def drop(self, i: int) -> None:
        """Forget a ready slot's contents without using them (makes it free for the next fill)."""
        s = self._slots[i]
        if s.state == "in_use":
            raise RingError(f"ring {self.name}: slot {i} dropped while in use (holding {s.key!r})")
        if s.state == "ready" and s.ready is not None:
            s.released = s.ready  # the next fill must still wait for the write that made it ready
        s.state = "free"

    def reset(self) -> None:
        """All slots free (between steps; the pending release events still order the next fills)."""
        for s in self._slots:
            if s.state == "in_use":
                raise RingError(f"ring {self.name}: reset while slot holding {s.key!r} is in use")
            s.state = "free"
