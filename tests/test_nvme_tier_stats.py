"""``TierStats`` counts the time the tier's transfers took (what profiling/bench_nvme_tier.py turns
into GB/s) beside their bytes, and an emulated pace is not part of it."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch

from sysx.optim.nvme.open_tier import open_tier
from sysx.optim.nvme.tier import TierStage


def test_transfer_times_are_counted_apart_from_the_pace(tmp_path: Path) -> None:
    paced: list[tuple[str, int]] = []

    def pace(kind: str, nbytes: int) -> None:
        paced.append((kind, nbytes))
        time.sleep(0.2)  # an emulated disk's time: not the transfer's

    settings = SimpleNamespace(offload="nvme", nvme_dir=str(tmp_path), nvme_engine="threads")
    stages = [TierStage.of(f"s{i}", 4096, param_in_ram=False, rollback="undo") for i in range(4)]
    tier = open_tier(settings, stages, job="statstest", node=0, rank=0, workers=1, pace=pace, pin=False)
    try:
        for i, st in enumerate(tier.stages.values()):
            st.fill(torch.full((4096,), float(i)))
        for st in tier.stages.values():
            with st.resident() as state:
                assert state[0][0].item() == float(st.name[1:])
            del state  # views of a staging buffer
        tier.flush()
        s = tier.stats
        assert s.write_bytes == 4 * stages[0].nbytes and s.read_bytes >= 2 * stages[0].nbytes
        assert 0 < s.write_s < 0.2 * s.writes and 0 < s.read_s < 0.2 * s.reads  # the pace is left out
        assert sorted(set(k for k, _ in paced)) == ["read", "write"]
    finally:
        tier.close()


def test_a_stage_waiting_for_a_buffer_is_read_once(tmp_path: Path) -> None:
    """On a slow disk a job may wait for a free buffer while the read-ahead looks for a stage to
    read: it must not read the waiting stage a second time (each use reads at most once)."""
    settings = SimpleNamespace(offload="nvme", nvme_dir=str(tmp_path), nvme_engine="threads")
    stages = [TierStage.of(f"s{i}", 1024, param_in_ram=False, rollback="undo") for i in range(6)]

    def pace(kind: str, nbytes: int) -> None:  # write-backs slow: every buffer is busy when a job comes
        time.sleep(0.06 if kind == "write" else 0.005)

    tier = open_tier(settings, stages, job="readonce", node=0, rank=0, workers=1, pace=pace)
    try:
        for st in tier.stages.values():
            st.fill(torch.zeros(1024))
        tier.flush()
        before, uses = tier.stats.reads, 0
        for _ in range(3):
            for st in tier.stages.values():
                with st.resident() as state:
                    state[1].add_(1.0)
                    st.mark_stale()
                del state
                uses += 1
        tier.flush()
        assert tier.stats.reads - before <= uses
    finally:
        tier.close()
