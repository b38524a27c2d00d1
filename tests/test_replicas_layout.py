"""``sysx.replicas``: the layout of R x P processes and the shard cut (pure data)."""

from __future__ import annotations

import pytest

from sysx.replicas import ReplicaLayout, shard_range


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 1000, 1001])
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_shards_cover_a_buffer_once_in_order(numel: int, shards: int) -> None:
    cuts = [shard_range(numel, shards, i) for i in range(shards)]
    assert [x for r in cuts for x in r] == list(range(numel))
    assert max(len(r) for r in cuts) - min(len(r) for r in cuts) <= 1


def test_replicas_are_contiguous_pipelines() -> None:
    # 2 nodes x 4 GPUs, P=4: replica 1 is node 1; its pipeline rank 2 is global rank 6
    lay = ReplicaLayout.of(2, 8, rank=6, local_world_size=4)
    assert (lay.pipeline, lay.replica, lay.stage_rank) == (4, 1, 2)
    assert lay.peers() == [2, 6] and lay.global_rank(0) == 4 and lay.global_rank(3, replica=0) == 3
    assert not lay.peers_share_node()
    # one node of 4, P=2: both replicas on the node
    assert ReplicaLayout.of(2, 4, rank=3, local_world_size=4).peers_share_node()
    assert lay.shard(10) == range(5, 10)
    assert [ReplicaLayout.of(2, 8, rank=r).turns(3) for r in (0, 4)] == [2, 1]  # micro-batches 0, 2 | 1


def test_a_world_size_not_a_multiple_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"parallel.replicas=3 does not divide the 4 processes") as err:
        ReplicaLayout.of(3, 4)
    assert "\n" not in str(err.value)


def test_reduction_path_of_each_layout() -> None:
    assert ReplicaLayout.of(1, 4, local_world_size=4).reduction == "none"
    assert ReplicaLayout.of(2, 4, local_world_size=4).reduction == "node"
    assert ReplicaLayout.of(2, 8, local_world_size=4).reduction == "network"
    with pytest.raises(ValueError, match=r"set parallel.replicas=2 \(one replica per node\)"):
        _ = ReplicaLayout.of(4, 8, local_world_size=4).reduction
