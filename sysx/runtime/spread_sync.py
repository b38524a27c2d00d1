"""The hand-off of a spread step (:mod:`sysx.schedule.spread`): the owner's offloaded gradients
reach the node's other ranks, which step their shards of the unit.

The owner's OFFLOAD_GRADS lands in a node segment (:attr:`sysx.runtime.stage_params.StageParams.spread_landing`).
Every sharer's optimizer job of the unit, the owner's too, waits on a :class:`HandOff`: the owner's
waits for its copy, then all of them meet in one all-reduce over the sharers' gloo group, which
carries the copy's end (a ``MAX`` of the owner's time and the others' zeros). After it each reads its
slice of the segment. The time is what an emulated device starts the shard's step from: the
sharers' clocks are one (``time.monotonic()`` on one node).

One job per rank per step meets in the group, on an optimizer worker. The group's other traffic is
on the main thread once VALIDATE has waited for that job: the sharers' meeting before a mirrored
unit's push (:meth:`~sysx.runtime.rank.RankRuntime.sharers_written`) and a save's gather.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from sysx import device as dev
from sysx.dist import wait_for
from sysx.emulate.pacer import Pacer
from sysx.emulate.streams import EmulatedEvent
from sysx.partition import unit_label

Unit = tuple[int, int]


def spread_groups(spread: dict[Unit, list[int]]) -> dict[Unit, dist.ProcessGroup]:
    """One gloo group per spread unit, over its sharers (collective over the whole job: every rank
    creates every group, in unit order)."""
    return {unit: dist.new_group(spread[unit], backend="gloo") for unit in sorted(spread)}


class HandOff(dev.Event):
    """What a sharer's optimizer job of a spread unit waits on (see the module doc): done once the
    owner's gradients are in the node segment; :meth:`synchronize` meets the other sharers."""

    def __init__(
        self,
        unit: Unit,
        *,
        offload: dev.Event | None,
        group: dist.ProcessGroup,
        rank: int,
        timeout_s: float,
        pacer: Pacer,
    ) -> None:
        """``offload``: the owner's copy to the host (None on the other sharers)."""
        super().__init__(torch.device("cpu"))
        self.unit, self.offload, self.group, self.rank = unit, offload, group, rank
        self.timeout_s, self.pacer = timeout_s, pacer
        self.ready_at: float | None = None  # the copy's end, host clock (known once met)
        self._done = threading.Event()

    def query(self) -> bool:
        """Whether the sharers have met."""
        return self._done.is_set()

    def synchronize(self) -> None:
        """The owner waits for its copy; then every sharer meets in the all-reduce (bounded by the
        timeout, a stop or a lost peer interrupting it)."""
        if self._done.is_set():
            return
        mine = 0.0
        if self.offload is not None:
            self.offload.synchronize()
            mine = self.offload.timestamp() if isinstance(self.offload, EmulatedEvent) else time.monotonic()
        t = torch.tensor([mine], dtype=torch.float64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        label = unit_label(*self.unit)
        what = f"hand-off of {label}'s gradients to the ranks sharing its step"
        wait_for(work, rank=self.rank, what=what, peer=None, timeout_s=self.timeout_s, collective=True)
        self.ready_at = float(t.item())
        self.pacer.unit_ready(label, self.ready_at)
        self.record()
        self._done.set()
