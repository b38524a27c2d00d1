"""``optim.rollback=exact``: two sets of ``(p, m, v)``; a step updates the spare in place, a rollback is not switching.

:class:`ExactState` holds the current set and a spare (12 bytes per parameter more). A speculative
step runs the backend's in-place step on the spare, a copy of the current set, and makes it current;
a rollback switches back. :meth:`ExactState.refresh` copies the current set into the spare after each
decision, off the critical path. A *final* step updates the current set in place and needs no spare.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class ExactState:
    """Two ``(p, m, v)`` sets of one flat fp32 parameter buffer (see docs/architecture.md)."""

    def __init__(self, param: torch.Tensor) -> None:
        n = param.numel()
        current = (param, torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.float32))
        self.sets: list[Triple] = [current, tuple(t.clone() for t in current)]  # type: ignore[list-item]
        self.current = 0
        self.stale = False  # True: the spare is not a copy of the current set
        self.lock = threading.Lock()  # a step and a refresh of this state never overlap
        self.inline_copies = 0  # refreshes a step had to make itself (none ran in time): on its critical path

    @property
    def spare_bytes(self) -> int:
        """Host memory of the second set (12 bytes per parameter)."""
        return sum(t.numel() * t.element_size() for t in self.sets[1])

    @property
    def state(self) -> Triple:
        """The current ``(p, m, v)``."""
        return self.sets[self.current]

    @property
    def spare(self) -> Triple:
        """The other ``(p, m, v)``."""
        return self.sets[1 - self.current]

    def step_spare(self, step: Callable[[Triple], None]) -> None:
        """``step`` the spare in place (refreshing it first if it is stale), then make it current.
        The caller holds :attr:`lock` (and counts the step under it, before a refresh can look)."""
        if self.stale:  # no refresh ran since the last change: pay it here, correctness first
            self.inline_copies += 1
            self._copy()
        self.stale = True  # from here on (also if the step fails) the spare is no copy of the current set
        step(self.spare)
        self.current = 1 - self.current  # the old current set is now the spare: a rollback needs it

    def step_current(self, step: Callable[[Triple], None]) -> None:
        """``step`` the current set in place (a final step: no rollback needs the spare); the caller
        holds :attr:`lock`."""
        self.stale = True
        step(self.state)

    def switch_back(self) -> None:
        """Roll the last spare step back: the set it read is current again, untouched; the caller
        holds :attr:`lock`."""
        self.current = 1 - self.current
        self.stale = True

    def mark_stale(self) -> None:
        """The current set was written from outside (checkpoint restore, the device lane): after the
        writes, so a refresh that copied during them does not count."""
        with self.lock:
            self.stale = True

    def refresh(self, allowed: Callable[[], bool]) -> bool:
        """Copy the current set into the spare when it is stale and ``allowed()`` (checked under the
        lock: no undoable step is pending). True when it copied."""
        with self.lock:
            if not (self.stale and allowed()):
                return False
            self._copy()
            return True

    def _copy(self) -> None:
        for src, dst in zip(self.state, self.spare):
            dst.copy_(src)  # ATen copy: releases the GIL, uses this thread's intra-op threads
        self.stale = False
