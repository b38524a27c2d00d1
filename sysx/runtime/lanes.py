"""``optim.placement`` for one pipeline rank: the inputs of :func:`sysx.optim.placement.choose`.

* On an emulated device (``device=emulated``) everything comes from the plan the run paces itself
  by: each owned sub-stage's parameters (of the emulated model), the time its gradients are home
  (the end of its OFFLOAD_GRADS in the simulated timeline), the end of the rank's passes, and the
  emulated cluster's copy rates, GPU memory bandwidth and CPU Adam throughput per worker, and the
  GPU memory the rank's planned peak leaves free.
* On a real device the rates are measured (:func:`sysx.machine.hardware.measure_hardware` and one
  CPU Adam thread's throughput, as the autotune profile measures them) and, without a cost table,
  every unit is taken as ready at the end of the backward (the device idle then too): the model
  then weighs the CPU lane's queue after the backward against the device lane's copies and steps.
  On a CPU-only job the "device" is the host, so ``auto`` keeps the CPU lane without measuring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sysx import device as dev
from sysx.optim.placement import LaneRates, Placement, Unit, choose, record
from sysx.partition import unit_label
from sysx.schedule import OpKind, Schedule

if TYPE_CHECKING:
    from sysx.emulate.costs import EmulatedPlan, LaneTimes


# a synchronous schedule steps on the main thread after the validation: both lanes would hold it
SYNC = "the schedule's optimizer steps on the main thread (synchronous), where the CPU lane is as good"


def emulated_rates(plan: EmulatedPlan, rank: int) -> LaneRates:
    """The emulated cluster's figures, per CPU worker as the plan's optimizer costs are; the lane may
    use the GPU memory the rank's planned peak leaves free."""
    hw = plan.cluster
    return LaneRates(
        cpu_params_per_s=plan.costs.optim_params_per_s,
        cpu_workers=plan.optimizer_workers,
        h2d_bytes_per_s=hw.h2d_bandwidth,
        d2h_bytes_per_s=hw.d2h_bandwidth,
        device_mem_bytes_per_s=hw.device_mem_bandwidth,
        device_free_bytes=hw.gpu_memory_bytes - plan.timeline.peak_gpu[rank],
    )


def emulated_units(plan: EmulatedPlan, schedule: Schedule, rank: int) -> tuple[list[Unit], float]:
    """Pipeline rank ``rank``'s owned sub-stages (emulated parameters, a replica's shard of them;
    modelled ready times) and when its passes end."""
    part, layer_params = schedule.partition, plan.costs.layer_params
    ready = {
        (ev.op.stage, ev.op.sub): ev.end
        for ev in plan.timeline.events
        if ev.rank == rank and ev.op.kind == OpKind.OFFLOAD_GRADS
    }
    shards = plan.table.replicas  # with replicas a rank steps 1/R of each unit
    units = [
        Unit(
            unit_label(s, k),
            int(sum(layer_params[i] for i in part.sub_layers(s, k))) // shards,
            ready.get((s, k), 0.0),
        )
        for s, k in schedule.assignment.bwd_substages(rank)
    ]
    return units, plan.timeline.gpu_end[rank]


def emulated_placement(
    mode: str, plan: EmulatedPlan, schedule: Schedule, rank: int, *, speculative: bool
) -> tuple[Placement, list[Unit]]:
    """``rank``'s placement on the emulated cluster, from the plan alone (so any rank, or the
    benchmark's planner, can compute every rank's)."""
    units, idle = emulated_units(plan, schedule, rank)
    placed = choose(
        mode if schedule.options.async_optimizer else "cpu",
        units,
        emulated_rates(plan, rank),
        device_idle=idle,
        speculative=speculative,
    )
    return (placed if schedule.options.async_optimizer else dataclasses.replace(placed, why=SYNC)), units


def measured_rates(device: torch.device, dtype: torch.dtype, *, workers: int, backend: str) -> LaneRates:
    """This machine's copy rates and device memory bandwidth, and one CPU thread's optimizer job throughput."""
    from sysx.machine.adam_rate import optimizer_job_params_per_s
    from sysx.machine.hardware import measure_hardware

    hw = measure_hardware(device, dtype)
    h2d, d2h = hw.pageable_copy_rates  # the lane copies the units' masters and moments, not page-locked
    return LaneRates(
        cpu_params_per_s=optimizer_job_params_per_s(dtype=dtype, threads=1, backend=backend),
        cpu_workers=workers,
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        overlapped=False,  # sysx.optim.device_lane: synchronous copies, one unit after another
        device_mem_bytes_per_s=hw.device_mem_bytes_per_s,
        device_free_bytes=hw.device_free_bytes,
    )


def rank_placement(
    mode: str,
    schedule: Schedule,
    rank: int,
    numels: dict[tuple[int, int], int],
    *,
    device: torch.device,
    dtype: torch.dtype,
    workers: int,
    backend: str,
    speculative: bool,
    plan: EmulatedPlan | None = None,
) -> tuple[Placement, list[Unit]]:
    """The placement of ``rank``'s owned sub-stages (``numels``: their parameters here) under
    ``optim.placement=mode``, and the units it placed; names are sub-stage labels (``s1.0``)."""
    if plan is not None:
        return emulated_placement(mode, plan, schedule, rank, speculative=speculative)
    if not schedule.options.async_optimizer:
        mode = "cpu"  # see SYNC
    units = [Unit(unit_label(*key), n, 0.0) for key, n in sorted(numels.items())]
    if mode == "cpu" or (mode == "auto" and not dev.is_cuda(device)):
        return Placement((), 0.0, 0.0, {}), units
    rates = measured_rates(device, dtype, workers=workers, backend=backend)
    placed = choose(mode, units, rates, device_idle=0.0, speculative=speculative, separate_device=dev.is_cuda(device))
    return placed, units


RankSplit = tuple[Placement, list[Unit]]


def gather_placements(mine: RankSplit, *, world: int, group: Any) -> list[RankSplit]:
    """Every rank's placement (collective over ``group``: every rank calls it), for rank 0's one line."""
    if world == 1:
        return [mine]
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine, group=group)
    return parts


def lane_times(schedule: Schedule, ranks: Sequence[RankSplit]) -> list[LaneTimes]:
    """Per rank, its device-lane sub-stages ``(s, k)`` with their modelled (in, step, out) seconds, in
    the lane's order (:func:`sysx.emulate.costs.device_lane_plan`'s input)."""
    out: list[LaneTimes] = []
    for r, (placed, _) in enumerate(ranks):
        keys = {unit_label(s, k): (s, k) for s, k in schedule.assignment.bwd_substages(r)}
        out.append({keys[n]: placed.device_times[n] for n in placed.device})
    return out


def placement_section(ranks: Sequence[RankSplit], mode: str) -> dict[str, Any]:
    """``summary.json``'s ``placement``: the mode and each rank's split (:func:`record`)."""
    return {"mode": mode, "ranks": [record(p, u) for p, u in ranks]}
