"""Step 4 of the single-GPU planner: which activations each transferring block saves (AdaWS's DP
over the save levels, or a policy's fixed level), whether blocks that never leave the device keep
their autograd graphs instead, and why."""

from __future__ import annotations

from typing import TypedDict

from sysx.machine.hardware import HardwareProfile
from sysx.single.act_capture import kept_graph_layout
from sysx.single.act_policy import LEVEL_NAMES, N_LEVELS, SaveProblem, simulate_forward, solve_save_levels
from sysx.single.plan_costs import LevelTable
from sysx.single.plan_request import ModelSizes, PlanError, PlanRequest, gib
from sysx.single.rings import align


class SaveChoice(TypedDict):
    """Why the save levels were chosen, and whether the ring drains the transfers without a stall."""

    reason: str
    feasible: bool
    stall_s: float


def choose_save_levels(
    req: PlanRequest,
    sizes: ModelSizes,
    hw: HardwareProfile,
    table: LevelTable,
    window: int,
    units: int,
    act_capacity: int,
    max_option: int | None = None,
) -> tuple[list[int], int, SaveChoice]:
    """Step 4's save level of every transferring block (the last ``window`` blocks stay on the device)
    and the level the activation slots are sized for: the AdaWS DP over levels up to ``max_option``
    for ``policy=dp``, else the policy's fixed level."""
    L, W = sizes.n_blocks, window
    n_tr = L - W
    fwd_round = table.forward_s * units
    bw = hw.d2h_bytes_per_s
    if req.policy in ("dp",):
        top = N_LEVELS - 1 if max_option is None else max_option
        opts = list(range(top + 1))
        problem = SaveProblem.make(
            [fwd_round] * L,
            [[table.slot_bytes[o] / bw for o in opts]] * n_tr,
            [[table.saved_s[o] * units for o in opts]] * n_tr,
            ring_slots=max(1, W * units),
            chunks=units,
            transfer_layers=n_tr,
            host_bytes=[[float(table.slot_bytes[o]) for o in opts]] * n_tr,
            host_capacity=float(act_capacity),
        )
        sol = solve_save_levels(problem)
        levels = list(sol.levels)
        slot_level = top
        if n_tr == 0:
            reason = (
                f"saved activations: no block leaves the device, so every block keeps level "
                f"'{LEVEL_NAMES[top]}' in its activation slots"
            )
        elif not sol.feasible:
            reason = (
                f"saved activations: even layer inputs only cannot be drained through the ring in time "
                f"(predicted forward stall {sol.stall_s * 1e3:.1f} ms per round): all blocks save level 0"
            )
        else:
            avoided = sol.value / max(1e-15, n_tr * table.forward_s * units) if n_tr else 1.0
            counts = {LEVEL_NAMES[o]: levels.count(o) for o in sorted(set(levels))}
            reason = (
                f"saved activations (AdaWS DP, {n_tr} transferring blocks, ring of {W * units} unit slots, "
                f"{'exact' if sol.exact else 'thinned'}): {counts}; recompute avoided {100 * avoided:.0f}% of their "
                f"forward; window blocks keep level '{LEVEL_NAMES[slot_level]}' on the device"
            )
        return levels, slot_level, SaveChoice(reason=reason, feasible=sol.feasible, stall_s=sol.stall_s)
    option = req.top_option
    levels = [option] * n_tr
    problem = SaveProblem.make(
        [fwd_round] * L,
        [[table.slot_bytes[option] / bw]] * n_tr,
        [[table.saved_s[option] * units]] * n_tr,
        ring_slots=max(1, W * units),
        chunks=units,
        transfer_layers=n_tr,
        host_bytes=[[float(table.slot_bytes[option])]] * n_tr,
        host_capacity=float(act_capacity),
    )
    ok, stall, _, host = simulate_forward(problem, [0] * n_tr)
    if host > act_capacity:
        raise PlanError(
            f"single.policy={req.policy}: saving '{table.names[option]}' on {n_tr} blocks needs {gib(host)} of host memory "
            f"but {gib(act_capacity)} is left after the training state; use single.policy=dp or raise single.host_memory_gb"
        )
    name = table.names[option]
    reason = (
        f"saved activations: fixed '{name}' on every block (single.policy={req.policy}); predicted forward stall "
        f"{stall * 1e3:.1f} ms per round" + ("" if ok else " (the ring cannot drain it in time)")
    )
    return levels, option, SaveChoice(reason=reason, feasible=ok, stall_s=stall)


def kept_graph_unit_bytes(req: PlanRequest, table: LevelTable, slot_level: int) -> int | None:
    """Device bytes of one unit of a block that keeps its forward's autograd graph (its slot: the
    layer input and what the graph saves, :func:`kept_graph_layout`), or None where blocks cannot
    keep it: ``single.keep_graph=false``, a policy that saves less than everything (the graph holds
    every activation), sequence chunks (a chunk's K/V cache is rebuilt for its backward) or a graph
    no smaller than the slot it replaces (compressed sites)."""
    if not req.keep_graph or slot_level != N_LEVELS - 1 or table.profile.graph_bytes is None:
        return None
    unit = align(kept_graph_layout(table.profile).nbytes)
    return unit if unit < align(table.slot_bytes[slot_level]) else None


def kept_graph_reason(table: LevelTable, units: int) -> str:
    """Why the blocks keep their autograd graphs, and what that holds against saving everything."""
    kept = units * align(kept_graph_layout(table.profile).nbytes)
    everything = units * align(table.slot_bytes[N_LEVELS - 1])
    return (
        f"saved activations: no block leaves the device and sequences are whole, so each block keeps its "
        f"forward's autograd graph until its backward, what it saves packed into the block's activation slots: "
        f"nothing recomputed or replayed, {gib(kept)} a block against {gib(everything)} of level 'everything' "
        f"(single.keep_graph=false: save sites and replay)"
    )
