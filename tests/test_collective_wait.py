"""``wait_for(..., collective=True)``: a collective is waited for in ``Work.wait`` slices on the
waiting thread (:func:`sysx.dist._wait_collective`), woken when it completes, bounded by the
timeout, and a failed one told from a slow one. The fakes pin the rules; two gloo processes pin
what they rest on: a collective's timed-out wait leaves it running."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sysx.dist import WAIT_SLICE_S, PeerTimeout, wait_for


class FakeCollective:
    """A collective whose ``wait`` times out ``pending`` times before it completes (``"broken"``:
    it completes with an error; ``pending=None``: it never completes). ``waits``: the timeouts asked
    (None: a wait without one). As gloo's, it reads completed once it is, whether or not a wait saw it."""

    def __init__(self, pending: int | None = 0, *, broken: bool = False) -> None:
        self.pending, self.broken = pending, broken
        self.waits: list[datetime.timedelta | None] = []

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if self.broken:
            raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:46226: Connection reset by peer\nmore")
        if self.pending is None:  # blocks for its timeout, as gloo's does
            time.sleep(timeout.total_seconds() if timeout is not None else 3600)
            raise RuntimeError("Operation timed out!")
        if self.pending > 0:
            self.pending -= 1
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self) -> bool:
        return self.broken or self.pending == 0


def test_a_collective_is_waited_for_in_slices_until_it_completes() -> None:
    work = FakeCollective(pending=3)
    wait_for(work, rank=0, what="VALIDATE", peer=None, timeout_s=30, collective=True)
    # three slices timed out, the third as the work completed: a wait without a timeout collects it
    assert len(work.waits) == 4 and work.waits[-1] is None
    slices = [w for w in work.waits[:3] if w is not None]
    assert len(slices) == 3
    assert all(datetime.timedelta(milliseconds=1) <= w <= datetime.timedelta(seconds=WAIT_SLICE_S) for w in slices)


def test_a_failed_collective_is_reported_at_once_and_a_stuck_one_at_its_timeout() -> None:
    broken = FakeCollective(broken=True)
    with pytest.raises(PeerTimeout, match=r"rank 1: VALIDATE failed after .*Connection reset by peer"):
        wait_for(broken, rank=1, what="VALIDATE", peer=None, timeout_s=30, collective=True)
    assert broken.waits[0] == datetime.timedelta(seconds=WAIT_SLICE_S) and len(broken.waits) == 2
    never = FakeCollective(pending=None)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout, match=r"rank 0: end of step 3 did not complete within 0.25 s"):
        wait_for(never, rank=0, what="end of step 3", peer=None, timeout_s=0.25, collective=True)
    assert 0.2 <= time.monotonic() - t0 < 30  # bounded by the timeout, not by the work
    # a zero timedelta is torch's "no timeout": a wait at its deadline still asks for a bounded one
    late = FakeCollective(pending=None)
    with pytest.raises(PeerTimeout, match="did not complete within 0 s"):
        wait_for(late, rank=0, what="x", peer=None, timeout_s=0.0, collective=True)
    assert late.waits == [datetime.timedelta(milliseconds=1)]


LATE_S = 0.35  # rank 1 joins the collectives this late: several of rank 0's wait slices time out first


def _rank_main(rank: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        found = {}
        for name in ("all_reduce", "barrier"):
            if rank == 1:
                time.sleep(LATE_S)
            t = torch.tensor([rank + 1.0])
            work = dist.all_reduce(t, async_op=True) if name == "all_reduce" else dist.barrier(async_op=True)
            t0 = time.monotonic()
            wait_for(work, rank=rank, what=name, peer=None, timeout_s=60, collective=True)
            found[name] = {"value": float(t.item()), "waited_s": time.monotonic() - t0}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def test_a_collective_outlives_its_timed_out_wait_slices_on_gloo(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, join=True)
    early = json.loads((tmp_path / "rank0.json").read_text())
    assert early["all_reduce"]["value"] == 3.0  # the sum of both ranks' values, after the slices timed out
    assert all(early[name]["waited_s"] >= LATE_S / 2 for name in ("all_reduce", "barrier")), early
    late = json.loads((tmp_path / "rank1.json").read_text())
    assert late["all_reduce"]["value"] == 3.0
