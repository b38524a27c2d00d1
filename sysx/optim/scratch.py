"""Reused fp32 buffers for gradients converted per job (``keep_grads=False``).

A 16-bit group keeps no fp32 gradient buffer of its own: each optimizer job converts the loaded
gradients into a temporary and frees it. A fresh ``torch.empty`` of a block's size is a fresh
``mmap`` (glibc maps every allocation over 32 MiB), so each job page-faults its whole buffer in
again: converting a 47M-parameter block that way took 375-631 ms on the 2-core CPU machine against
47-70 ms into a reused buffer. The jobs in flight are bounded (the workers and the trainer's own
thread), so a few buffers of the largest group serve them all; the planner counts exactly these.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class ScratchPool:
    """``count`` fp32 buffers of ``numel`` elements, made on first use by ``alloc`` (e.g. page-locked
    :class:`sysx.memory.pinned.HostBuffers`) and lent out one at a time. When all are lent, a
    plain temporary is made instead, as without a pool."""

    def __init__(self, numel: int, count: int, alloc: Callable[[int], torch.Tensor] | None = None) -> None:
        if numel < 1 or count < 1:
            raise ValueError(f"ScratchPool: numel={numel} and count={count} must be >= 1")
        self.numel = numel
        self.count = count
        self._alloc = alloc or (lambda n: torch.empty(n, dtype=torch.float32))
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> the whole buffer a view was cut from
        self._lock = threading.Lock()

    def take(self, n: int) -> torch.Tensor:
        """A flat fp32 tensor of ``n`` elements (uninitialised)."""
        if n > self.numel:
            return torch.empty(n, dtype=torch.float32)
        with self._lock:
            if self._free:
                buf = self._free.pop()
            elif self._made < self.count:
                buf = self._alloc(self.numel)
                self._made += 1
            else:
                return torch.empty(n, dtype=torch.float32)
            self._lent[buf.data_ptr()] = buf
        return buf[:n]

    def give(self, t: torch.Tensor) -> None:
        """Return what :meth:`take` lent (a temporary made when all were lent is simply dropped)."""
        with self._lock:
            buf = self._lent.pop(t.data_ptr(), None)
            if buf is not None:
                self._free.append(buf)

    @property
    def lent(self) -> int:
        """Buffers lent out now."""
        return len(self._lent)

    def close(self) -> None:
        """Forget every buffer (views still lent keep theirs alive until dropped)."""
        with self._lock:
            self._free.clear()
            self._lent.clear()
