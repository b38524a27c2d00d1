"""optim.offload=nvme planning: the tier's cost arithmetic (hand-checked numbers) and the plan lines."""

from __future__ import annotations

import pytest

from sysx.memory.budget import plan_host_memory, training_state_bytes
from sysx.memory.node_plan import UnitPlace, node_host_memory
from sysx.optim.nvme.cost import (
    DiskRates,
    disk_shortage,
    largest_model,
    micro_batches_to_hide,
    step_io,
    tier_bytes,
)
from sysx.replicas import ReplicaLayout

GiB = 2**30


@pytest.mark.parametrize(
    ("dtype", "rollback", "disk", "io", "host"),
    [
        ("bfloat16", "undo", 12, 12, 6),  # master + m + v on disk; bf16 copy + fp32 grads in RAM
        ("bfloat16", "snapshot", 24, 12, 6),  # the second set on disk too
        ("bfloat16", "exact", 24, 12, 6),
        ("float32", "undo", 8, 8, 8),  # the master is the working copy: only m and v move
        ("float32", "snapshot", 20, 8, 8),  # the snapshot's p, m, v
        ("float32", "exact", 24, 8, 8),  # exact + fp32: a private master too
    ],
)
def test_state_bytes_per_parameter(dtype: str, rollback: str, disk: int, io: int, host: int) -> None:
    plain = training_state_bytes(dtype, rollback=rollback)
    tier = training_state_bytes(dtype, rollback=rollback, offload="nvme")
    assert (tier.disk, tier.step_io, tier.total) == (disk, io, host)
    assert tier.disk == plain.master + plain.adam + plain.snapshot  # what moved is what the host plan counted
    assert tier.total + tier.disk == plain.total


def test_tier_bytes_of_two_stages() -> None:
    stages = [(1000, "bfloat16"), (3000, "bfloat16")]
    got = tier_bytes(stages)
    assert (got.disk, got.read, got.write) == (48_000, 48_000, 48_000)
    # RAM loses 12 bytes/param and gains 3 staging buffers of the largest stage, each 36,000 B -> 9 pages
    assert got.host_with - got.host_without == 3 * 9 * 4096 - 48_000
    assert (got.rollback_read, got.rollback_write) == (48_000, 48_000)  # undo reads back and writes again
    snap = tier_bytes(stages, rollback="snapshot")
    assert (snap.disk, snap.rollback_read, snap.rollback_write) == (96_000, 0, 0)
    host = plan_host_memory(stages, rollback="snapshot", offload="nvme")
    assert host.master == host.optimizer == host.rollback == 0 and "state files on disk" in str(host)


def test_node_plan_with_the_tier_counts_one_pool_per_owning_rank() -> None:
    units = [UnitPlace(3000, 0, 0), UnitPlace(1000, 1, 0)]
    two = ReplicaLayout(2, 2, 0, local_world_size=4)  # 2 replicas of 2 ranks on one node: shards of 1/2
    plain = node_host_memory(units, two, 0, "bfloat16")
    tier = node_host_memory(units, two, 0, "bfloat16", offload="nvme")
    assert tier.disk == 4000 * 12 and tier.step_io == 4000 * 12
    # ranks 0 and 2 own 1500-param shards (18,000 B -> 5 pages), ranks 1 and 3 500 (6,000 B -> 2 pages)
    assert tier.pinned - plain.pinned == 3 * 4096 * (5 + 5 + 2 + 2)
    assert tier.total == plain.total - 4000 * 12 + 3 * 4096 * 14
    assert tier.shared == plain.shared and tier.grads == plain.grads


def test_overlap_model_hand_checked() -> None:
    rates = DiskRates(5e9, 2.5e9)
    slow = step_io(10e9, 10e9, rates, step_s=4.0)  # read 2 s + write 4 s on one queue
    assert (slow.io_s, slow.exposed_s, slow.hidden) == (6.0, 2.0, False)
    assert step_io(10e9, 10e9, rates, step_s=8.0).exposed_s == 0.0
    assert "exposed 2 s (50% of the step)" in slow.describe()
    # step(4) = 2 s, step(8) = 3 s: 1 s + 0.25 s per micro-batch reaches 6 s at 20 micro-batches
    assert micro_batches_to_hide(6.0, (4, 2.0), (8, 3.0)) == 20
    assert micro_batches_to_hide(6.01, (4, 2.0), (8, 3.0)) == 21
    assert micro_batches_to_hide(0.5, (4, 2.0), (8, 3.0)) == 1
    assert micro_batches_to_hide(6.0, (4, 2.0), (8, 2.0)) is None


def test_largest_model_with_and_without_the_tier() -> None:
    # bf16 + undo: 20 B/param in RAM without the tier (18 + the 2-byte landing buffer), 8 with it, 12 on disk
    plain, tier = largest_model(128 * GiB, 1e12, "bfloat16")
    assert plain.params == 128 * GiB // 20 and plain.limit == "host memory"
    assert tier is not None and tier.params == 128 * GiB // 8 and tier.limit == "host memory"
    _, small = largest_model(128 * GiB, 100e9, "bfloat16")
    assert small is not None and (small.params, small.limit) == (int(100e9 // 12), "disk")
    assert largest_model(128 * GiB, None, "bfloat16")[1] is None


def test_disk_shortage_is_one_line_with_the_numbers() -> None:
    assert disk_shortage(10, 10, "/nvme") is None
    line = disk_shortage(3 * GiB, GiB, "/nvme")
    assert line is not None and "\n" not in line
    assert "optim.nvme_dir=/nvme has 1.0 GiB free" in line and "need 3.0 GiB" in line


def test_disk_profile_is_measured_once_per_drive_and_cached(tmp_path, monkeypatch) -> None:
    from sysx.machine.disk_cache import disk_path, load_or_measure_disk

    monkeypatch.setenv("SYSX_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[str] = []

    def probe(directory: str, engine: str) -> dict:  # stands in for sysx.optim.nvme.probe.measure_disk
        calls.append(directory)
        return {"read_Bps": 3e9, "write_Bps": 2e9, "direct": True, "engine": "threads", "free_bytes": 1}

    first, reused = load_or_measure_disk(str(tmp_path), measure=probe)
    assert not reused and (first.read_bytes_per_s, first.write_bytes_per_s) == (3e9, 2e9)
    assert first.free_bytes is not None and first.free_bytes > 1  # read now, not the probe's figure
    (tmp_path / "other").mkdir()
    again, reused = load_or_measure_disk(str(tmp_path / "other"), measure=probe)  # same drive: cached
    assert reused and again.read_bytes_per_s == 3e9 and calls == [str(tmp_path)]
    load_or_measure_disk(str(tmp_path), measure=probe, refresh=True)
    assert len(calls) == 2
    assert disk_path(str(tmp_path)) != disk_path(str(tmp_path), "aio")
    with pytest.raises(FileNotFoundError, match="optim.nvme_dir="):
        load_or_measure_disk(str(tmp_path / "missing"), measure=probe)
