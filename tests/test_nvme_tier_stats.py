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
