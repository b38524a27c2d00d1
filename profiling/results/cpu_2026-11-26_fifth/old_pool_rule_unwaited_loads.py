"""Replays the parameter pool's old rule (a freed extent whose compute was done left the list without
a wait unless the load overlapped it) in 3 steps of ``profiling/gpu_check.py``'s 1-process runs, and
counts the loads that overwrote such an extent before the H2D stream had waited for its release or
a later one (every release is an event on the one compute stream, so a later one orders it too):
an order the CUDA sanitizer cannot see.

    PYTHONPATH=. .venv/bin/python profiling/results/cpu_2026-11-26_fifth/old_pool_rule_unwaited_loads.py
"""

from __future__ import annotations

import sys
from typing import Any

sys.path.insert(0, "profiling")

import gpu_check

from sysx.config import load_config
from sysx.runtime import PipelineOptions
from sysx.runtime import buffers as B
from sysx.trainers.pipeline import PipelineTrainer

hits: list[str] = []
loads = [0]


def old_load(self: Any, unit: Any, layers: range, pieces: Any, label: str, at: int) -> None:
    """ParamPool.load with the old rule, noting the extents it dropped unwaited (with their release's
    place in the compute stream's order) and the latest release the H2D stream has waited for."""
    lo, hi = at, at + self.offsets[layers.stop] - self.offsets[layers.start]
    dropped, waited = getattr(self, "_dropped", []), getattr(self, "_waited", -1)
    loads[0] += 1
    if any(a < hi and lo < b and waited < seq for a, b, seq in dropped):
        hits.append(label)
    pending = []
    for a, b, event in self.released:
        overlap = a < hi and lo < b
        if overlap:
            self.h2d.wait_event(event)
            waited = max(waited, seq_of[id(event)])
        if not event.query() and not (lo <= a and b <= hi):
            pending.append((a, b, event))
        elif not overlap:
            dropped.append((a, b, seq_of[id(event)]))  # left the list without a wait
    self._dropped, self._waited = [d for d in dropped if waited < d[2]], waited
    self.released = pending
    with self.h2d.use():
        offset = lo
        for piece in pieces:
            self.buffer[offset : offset + piece.numel()].copy_(piece)
            offset += piece.numel()
        ready = self.h2d.record_event()
    self.units[unit] = B.Loaded(layers, lo, hi, ready)


seq_of: dict[int, int] = {}
new_free = B.ParamPool.free


def numbered_free(self: Any, unit: Any, label: str) -> None:
    """ParamPool.free, numbering its release event in the compute stream's order."""
    new_free(self, unit, label)
    seq_of[id(self.released[-1][2])] = len(seq_of)


B.ParamPool.load = old_load  # type: ignore[method-assign]
B.ParamPool.free = numbered_free  # type: ignore[method-assign]
for schedule in ("gpipe", "sysx"):
    hits.clear()
    loads[0] = 0
    trainer = PipelineTrainer(
        load_config(gpu_check._small("cpu")), PipelineOptions(optim_backend="torch", schedule=schedule)
    )
    try:
        trainer.run(3)
    finally:
        trainer.close()
    print(f"{schedule}: {loads[0]} loads, {len(hits)} over an extent dropped unwaited; first: {hits[:3]}")
