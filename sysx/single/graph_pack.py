"""Where a block's kept autograd graph puts what it saves: one byte region, planned like a slot.

A block that never leaves the device keeps its forward's graph until its backward
(:func:`sysx.single.act_capture.run_keeping_graph`). Left to the allocator, the tensors the graph
saves would live among the forward's short-lived ones: on the CPU machine glibc's heap kept 0.4 GiB
more than the 50M window's plan (+15%), gone with ``MALLOC_MMAP_THRESHOLD_`` (-3%), and on a GPU the
caching allocator may fragment the same way under a hard budget. :class:`GraphPacker` is a
``saved_tensors_hooks`` pair that copies each storage the graph saves, once, into a region of the
block's activation slot, so the window's device memory stays the arena's, planned to the byte. Run
without a region it only counts the bytes (the profile's :attr:`LayerProfile.graph_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

ALIGN = 256  # byte alignment of every tensor inside an activation slot, a packed storage included

# (byte offset in the region, bytes of the storage, dtype, size, stride, offset in the storage)
Packed = tuple[int, int, torch.dtype, torch.Size, tuple[int, ...], int]


def slot_align(n: int) -> int:
    """``n`` bytes rounded up to :data:`ALIGN` (where the next tensor in a slot starts)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def storage_key(t: torch.Tensor) -> int:
    """One number per storage, the same for all its views (``meta`` tensors too, which have no address)."""
    return int(t.untyped_storage()._cdata)


class GraphPacker:
    """Hooks that move what autograd saves on ``device`` into ``region`` (uint8, on that device), each
    storage once, except the storages of ``skip`` (the layer's weights and its input, which live in
    the rings); a tensor on another device (a fused attention kernel's RNG state on the host) stays
    where it is. Without a region it only counts: :attr:`nbytes` is the region a forward needs.

    It holds each storage it packed until :meth:`done` (the end of the forward), so that no storage
    is freed while the forward runs and its key reused by another."""

    def __init__(self, skip: Iterable[torch.Tensor], device: torch.device, region: torch.Tensor | None = None) -> None:
        self.skip = {storage_key(t) for t in skip}
        self.device = torch.device(device)
        self.region = region
        self.nbytes = 0
        self._offsets: dict[int, int] = {}
        self._held: list[torch.Tensor] = []

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context that routes a forward's saved tensors through this packer."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> torch.Tensor | Packed:
        """Copy ``t``'s storage into the region (once per storage) and return where it went."""
        storage = t.untyped_storage()
        key = int(storage._cdata)  # storage_key, the storage read once
        if key in self.skip or t.device != self.device:
            return t
        n = storage.nbytes()
        off = self._offsets.get(key)
        if off is None:
            off = self._offsets[key] = self.nbytes
            self.nbytes += slot_align(n)
            self._held.append(t)
            if self.region is not None:
                if self.nbytes > self.region.numel():
                    raise RuntimeError(
                        f"GraphPacker: the forward saves more than the {self.region.numel()} bytes planned for its "
                        f"graph (at least {self.nbytes}); the layer's saved tensors changed since it was profiled. "
                        f"Save sites and replay instead: single.keep_graph=false"
                    )
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                self.region[off : off + n].copy_(whole)
        if self.region is None:
            return t
        return (off, n, t.dtype, t.shape, t.stride(), int(t.storage_offset()))

    def unpack(self, packed: torch.Tensor | Packed) -> torch.Tensor:
        """The saved tensor, a view of the region."""
        if isinstance(packed, torch.Tensor):
            return packed
        assert self.region is not None
        off, n, dtype, size, stride, offset = packed
        flat = self.region[off : off + n].view(dtype)
        return flat.as_strided(size, stride, flat.storage_offset() + offset)

    def done(self) -> int:
        """End of the forward: let go of the originals; the bytes the region holds."""
        self._held.clear()
        self._offsets.clear()
        return self.nbytes
