"""``optim.placement`` of a pipeline run: each rank chooses which of its owned sub-stages step on
the device lane (:mod:`sysx.runtime.lanes`), hands them to its :class:`RankOptimizer`, and every
rank's choice is gathered: rank 0 prints one line with the predicted saving, the per-rank detail
goes to ``summary.json`` (``placement``), and an emulated device's plan takes the lane in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sysx import device as dev
from sysx.emulate.device_model import DeviceModel
from sysx.optim.device_lane import DeviceLane
from sysx.optim.placement import Placement, summarize
from sysx.partition import unit_label
from sysx.runtime.lanes import gather_placements, lane_times, placement_section, rank_placement
from sysx.runtime.rank import RankRuntime


@dataclass
class OptimizerPlacement:
    """This rank's placement and, when the ranks' choices were gathered, theirs."""

    placement: Placement
    section: dict[str, Any] = field(default_factory=dict)  # summary.json's ``placement`` ({}: not gathered)


def place_optimizer(
    rank: RankRuntime, model: DeviceModel, *, mode: str, backend: str, speculative: bool
) -> OptimizerPlacement:
    """Place ``rank``'s optimizer sub-stages under ``optim.placement=mode`` (see the module doc). On an
    emulated device (``model.plan``) the plan's figures replace measurements, the host steps the
    lane's units and the pacer times them, and the plan takes every rank's lane in. Collective
    (every rank calls it) unless every rank keeps the CPU lane."""
    optimizer, schedule, plan = rank.optimizer, rank.schedule, model.plan
    placement, units = rank_placement(
        mode,
        schedule,
        rank.stage_rank,
        # a spread step's shard stays on the CPU lane: sharing it over the node's CPUs is its point
        {k: s.numel for k, s in optimizer.stages.items() if k not in rank.params.spread},
        device=rank.device,
        dtype=rank.dtype,
        workers=optimizer.threads.workers,
        backend=backend,
        speculative=speculative,
        plan=plan,
    )
    if placement.device:
        keys = {unit_label(*k): k for k in optimizer.stages}
        lane = DeviceLane(None if plan is not None else rank.device)  # emulated: the host steps, the pacer times it
        optimizer.use_device_lane({keys[n]: placement.device_times[n] for n in placement.device}, lane, model.pacer)
    modelled = plan is not None or dev.is_cuda(rank.device)  # auto on a CPU device: no second lane to model
    if mode == "cpu" or (mode == "auto" and not (schedule.options.async_optimizer and modelled)):
        return OptimizerPlacement(placement)  # nothing to say or to gather: every rank keeps the CPU lane
    # every replica places alike (one plan, one schedule): the first replica's ranks are the pipeline's
    ranks = gather_placements((placement, units), world=rank.world, group=rank.group)[: schedule.n_ranks]
    model.take_device_lane(lane_times(schedule, ranks))
    if rank.rank == 0 and any(p.device or p.cpu_finish > 0 for p, _ in ranks):
        more = "; per rank: summary.json (placement)" if rank.world > 1 else ""
        print(f"optim.placement={mode}: {summarize(ranks, 'sub-stage')}{more}", flush=True)
    return OptimizerPlacement(placement, placement_section(ranks, mode))
