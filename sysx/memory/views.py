"""Torch tensors over an ``mmap`` whose lifetime cannot outlive the mapping.

``mmap.close()`` succeeds while a plain ``torch.frombuffer`` tensor still views it, and touching the
tensor afterwards segfaults. Here every tensor is built over its *own* ``memoryview`` of the map;
``torch.frombuffer`` keeps that memoryview alive for as long as the tensor's storage lives (views
derived from the tensor included), and a live memoryview makes ``mmap.close()`` raise
``BufferError``. So :meth:`MappedBuffer.close` either unmaps (no view left anywhere) or raises
:class:`LiveViewsError` and leaves everything intact - never a dangling tensor.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class LiveViewsError(RuntimeError):
    """A mapping cannot be closed because tensors still view it."""


def drop_failure_views(exc: BaseException | None = None) -> None:
    """Clear the locals of the finished frames of ``exc`` (default: the exception being handled, as in
    a ``finally`` on the way out of a failure) and of its causes and contexts.

    A failed step's frames (the executor's handlers, torch's own Python functions) hold tensors that
    view shared memory, so closing the mapping on the way out raised :class:`LiveViewsError` in
    place of the real error (second H200 lease: a sanitizer failure reported as live views of
    ``s1.2``). Frames still running, the caller's, keep their locals."""
    pending = [exc if exc is not None else sys.exc_info()[1]]
    seen: set[int] = set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        pending += [e.__cause__, e.__context__]


_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32"}


def canonical_dtype(dtype: Any) -> str:
    """The short name of a torch dtype or dtype name (``torch.float`` -> ``"float32"``), torch-free."""
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in _ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; use a torch dtype or one of {sorted(_ITEMSIZE)}")
    return name


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of a torch dtype or a dtype name (``"bfloat16"``, ``"torch.float32"``)."""
    return _ITEMSIZE[canonical_dtype(dtype)]


def torch_dtype(dtype: Any) -> torch.dtype:
    """A torch dtype from a torch dtype or its name."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, canonical_dtype(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not available in this torch")
    return value


class MappedBuffer:
    """An ``mmap`` plus the tensors viewing it; closes only when no view is left."""

    def __init__(self, mm: mmap.mmap, label: str) -> None:
        self._mm: mmap.mmap | None = mm
        self.label = label
        self.size = len(mm)
        self._exports: list[memoryview] = []  # one per tensor; torch's storage holds a reference while alive
        address_holder = ctypes.c_char.from_buffer(mm)
        self.address = ctypes.addressof(address_holder)
        del address_holder  # drop the export at once, or close() could never succeed

    @property
    def closed(self) -> bool:
        """True once unmapped."""
        return self._mm is None

    def tensor(self, dtype: Any, byte_offset: int, numel: int) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` starting ``byte_offset`` bytes into the
        map, sharing its memory (zero copy)."""
        import torch

        if self._mm is None:
            raise ValueError(f"{self.label} is closed; attach it again to get tensors")
        dt = torch_dtype(dtype)
        end = byte_offset + numel * dtype_itemsize(dt)
        if byte_offset < 0 or numel <= 0 or end > self.size:
            raise ValueError(
                f"{self.label}: view [{byte_offset}, {end}) of {numel} x {dt} is outside the {self.size}-byte mapping"
            )
        if byte_offset % dtype_itemsize(dt):
            raise ValueError(f"{self.label}: byte offset {byte_offset} is not aligned to {dt}")
        self._prune()
        export = memoryview(self._mm)
        self._exports.append(export)
        return torch.frombuffer(export, dtype=dt, count=numel, offset=byte_offset)

    def _prune(self) -> None:
        """Release the memoryviews whose tensors (and every view derived from them) are gone."""
        alive = []
        for export in self._exports:
            # references: our list, the loop variable, getrefcount's argument - and torch's storage
            # (which Py_INCREFs the buffer object in torch.frombuffer) while any view of it lives
            if sys.getrefcount(export) > 3:
                alive.append(export)
            else:
                export.release()
        self._exports = alive

    def live_views(self) -> int:
        """How many tensors handed out by :meth:`tensor` still have live storage (views derived
        from them keep it alive too)."""
        self._prune()
        if self._exports:  # only then can views caught in reference cycles matter: collect (slow) and look again
            gc.collect()
            self._prune()
        return len(self._exports)

    def close(self, before_unmap: Callable[[], None] | None = None) -> None:
        """Unmap. Raises :class:`LiveViewsError` and changes nothing while any tensor views the
        map; ``before_unmap`` runs after that check, just before unmapping."""
        if self._mm is None:
            return
        live = self.live_views()
        if live:
            raise LiveViewsError(
                f"cannot close {self.label}: {live} tensor(s) over it are still alive (tensors returned by the "
                "store or views of them, e.g. model parameters bound to the buffer); delete them "
                "(del tensor; model parameters: rebind or delete the model) before close()"
            )
        if before_unmap is not None:
            before_unmap()
        try:
            self._mm.close()
        except BufferError:  # an export we did not create (someone called memoryview on it)
            raise LiveViewsError(f"cannot close {self.label}: a buffer export of it is still alive") from None
        self._mm = None
