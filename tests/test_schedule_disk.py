"""``sysx.schedule.disk``: the NVMe tier's disk lane replayed beside a simulated iteration, checked
by hand on one rank and one sub-stage, and the search for the batch at which the disk hides."""

from __future__ import annotations

import dataclasses

import pytest

from sysx.model import get_preset
from sysx.runtime import PipelineOptions
from sysx.runtime.options import make_schedule
from sysx.schedule import UnitCosts, simulate
from sysx.schedule.disk import DiskCosts, disk_costs, hiding_point, with_disk


def _one_unit() -> tuple:
    """One rank, one stage of one sub-stage: forward 1, backward 2, offload 0, step 1 (ready at 3,
    the iteration 4 without a disk)."""
    cfg = dataclasses.replace(get_preset("tiny"), n_layers=2)
    opts = PipelineOptions(schedule="sysx", optim_backend="torch", stages_per_rank=1, split=1)
    schedule = make_schedule(opts, cfg, n_ranks=1, n_micro=1, seq_len=16)
    table = UnitCosts(t_opt=1.0).table(schedule)
    return schedule, table, simulate(schedule, table)


def test_a_slow_disk_adds_its_read_and_write_to_the_step() -> None:
    """Read 2, write 5: the first iteration reads during the forward and backward (4); from then on
    the read waits for the previous write-back: read, step, write = 8 a step, 4 of it waited."""
    schedule, table, timeline = _one_unit()
    io = with_disk(schedule, timeline, table, DiskCosts([1.0], 0.5, 0.2, slots=3))
    assert timeline.iteration == 4.0
    assert io.iterations == [4.0, 8.0, 8.0, 8.0]
    assert (io.iteration, io.exposed, io.wait, io.read, io.write) == (8.0, 4.0, [4.0], [2.0], [5.0])


def test_a_fast_disk_hides_behind_the_step() -> None:
    schedule, table, timeline = _one_unit()
    io = with_disk(schedule, timeline, table, DiskCosts([1.0], 2.0, 2.0))
    assert io.iterations == [4.0] * 4 and io.exposed == 0.0 and io.wait == [0.0]


def test_the_node_drives_are_shared_by_its_ranks() -> None:
    table = _one_unit()[1]
    disk = disk_costs(table, state_bytes_per_param=12, read_bandwidth=48.0, write_bandwidth=24.0, ranks_per_node=4)
    assert (disk.nbytes, disk.read, disk.write) == ([12.0], [1.0], [2.0])
    with pytest.raises(ValueError, match="must be > 0"):
        disk_costs(table, state_bytes_per_param=12, read_bandwidth=0.0, write_bandwidth=1.0, ranks_per_node=1)


@pytest.mark.parametrize("first", [1, 5, 37, 100])
def test_the_hiding_point_is_the_first_hidden_batch(first: int) -> None:
    seen: list[int] = []

    def hidden(m: int) -> bool:
        seen.append(m)
        return m >= first

    assert hiding_point(hidden) == first
    assert len(seen) <= 16
    assert hiding_point(lambda m: False, limit=64) is None
