"""The window's compute priced from its own passes, timed on the training device (issue 27, point 3).

The planner prices a block by its sites' FLOPs at the measured large-matmul rate and its other ops
by their bytes at the memory rate, and a backward at twice the forward. On a GPU the sites are
timed instead (``use_measured_times``). On a CPU neither holds for small shapes: a tiny model's
matmuls, its CPU attention kernel and its ~70 small ops per block forward run at a fraction of the
512^3 matmul rate, and the capture of the saved sites and the replayed backward add Python work per
op. :func:`measure_passes` times what the executor runs, on the block the plan chose (one unit's
captured forward and replayed backward at the window's save level) and on the Head (one chunk's
loss forward and backward); :func:`timed_plan` re-prices the plan's step with them, scaling every
site's time by the forward's measured/estimated ratio so the other save levels keep their
proportions. The plan's choices stay those of the FLOPs model: only its predicted times change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sysx.machine.hardware import mean_in_rounds
from sysx.single.act_capture import (
    backward_kept,
    backward_replayed,
    kept_graph_layout,
    run_captured,
    run_keeping_graph,
)
from sysx.single.op_profile import run_layer
from sysx.single.plan_costs import LevelTable, predict_step
from sysx.single.plan_report import SinglePlan

# each pass is the mean of this many rounds over the passes, one window of SPAN_S / ROUNDS a round
# (:func:`~sysx.machine.hardware.mean_in_rounds`, as the pipeline's layer profile times them): the
# fastest described a shared CPU's quiet moments (the 50M window measured 1.3-1.5x it at load 3-5)
ROUNDS = 5
# a pass's windows together: 5 runs of a tiny model's pass (a few ms) fit in one burst of another
# process's work, and twice in ten CPU check rounds the plan came out 14% slow (0.228 and 0.247 s
# predicted where the run measured 0.195-0.21 s). Not longer: every schedule=single job on a CPU
# times three passes at start (0.25 s a pass made the test suite 70 s longer)
SPAN_S = 0.1


@dataclass(frozen=True)
class PassTimes:
    """Seconds of the window's passes measured on the device."""

    forward_s: float  # one unit's captured forward through one block
    backward_s: float  # that unit's replayed backward through the block
    head_s: float  # one chunk's Head forward and backward (the loss)


def measure_passes(plan: SinglePlan, device: torch.device, *, rounds: int = ROUNDS) -> PassTimes | None:
    """Time a Block's captured forward and replayed backward on one unit at the window's save level
    (its forward keeping the graph and the backward through it, when the plan keeps graphs), and the
    Head's loss forward and backward on one chunk, as the executor runs them, by the wall clock (a
    CPU's passes: a GPU's sites are timed by the planner's profiler); None with
    sequence chunks (their K/V cache makes a unit's passes depend on its position). The plan's
    profile must be the device's (:func:`~sysx.single.op_profile.device_profiler`): its op sequence
    is what the capture checks."""
    from sysx.model.llama import init_layer, make_layer

    req, cfg = plan.request, plan.request.model
    if plan.seq_chunk < req.seq_len:
        return None
    gen = torch.Generator(device="cpu").manual_seed(0)
    block = make_layer(cfg, 1, dtype=req.dtype, device=device)
    head = make_layer(cfg, cfg.n_layers + 1, dtype=req.dtype, device=device)
    init_layer(block, 1)
    init_layer(head, cfg.n_layers + 1)
    profile = plan.table.profile
    layout = kept_graph_layout(profile) if plan.keep_graph else plan.table.layouts[plan.slot_level]
    slot = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    shape = (plan.chunk, req.seq_len, cfg.dim)
    x = torch.randn(shape, generator=gen).to(device=device, dtype=req.dtype)
    grad = torch.randn(shape, generator=gen).to(device=device, dtype=req.dtype) * 1e-3
    labels = torch.randint(0, cfg.vocab_size, shape[:2], generator=gen).to(device)

    def head_pass() -> None:
        hidden = x.detach().requires_grad_(True)
        head(hidden, labels).backward()

    with torch.no_grad():
        run_layer(block, x, None)  # fill the caches the layer keeps (RoPE tables), as the profile did
    if plan.keep_graph:  # a backward needs a fresh graph: time both passes, less the forward
        y = torch.empty_like(x)
        steps = [
            lambda: run_keeping_graph(block, x, layout, slot, out=y),
            lambda: backward_kept(run_keeping_graph(block, x, layout, slot, out=y), grad),
        ]
    else:
        steps = [
            lambda: run_captured(block, x, profile, layout, slot),
            lambda: backward_replayed(block, grad, profile, layout, slot),
        ]
    forward, second, head_s = mean_in_rounds([*steps, head_pass], rounds=rounds, window_s=SPAN_S / rounds)
    return PassTimes(forward, max(second - forward, 0.0) if plan.keep_graph else second, head_s)


def calibrated_table(table: LevelTable, passes: PassTimes, slot_level: int) -> LevelTable:
    """``table`` with the measured passes: the forward measured, every site's time (what each save
    level avoids recomputing) scaled by measured/estimated, the backward's ratio to the forward
    solved from the measured backward at ``slot_level``, and the Head measured."""
    scale = passes.forward_s / table.forward_s if table.forward_s > 0 else 1.0
    saved = tuple(s * scale for s in table.saved_s)
    extra = table.backward_extra_s * scale
    recompute = passes.forward_s - saved[slot_level] + extra  # the predictor's recompute at that level
    ratio = max(passes.backward_s - recompute, 0.0) / passes.forward_s if passes.forward_s > 0 else 2.0
    return dataclasses.replace(
        table,
        forward_s=passes.forward_s,
        saved_s=saved,
        backward_extra_s=extra,
        backward_ratio=ratio,
        head_s=passes.head_s,
    )


def timed_plan(plan: SinglePlan, passes: PassTimes | None) -> SinglePlan:
    """``plan`` with its step time, policy rows and table re-priced from ``passes`` (unchanged for None)."""
    if passes is None:
        return plan
    table = calibrated_table(plan.table, passes, plan.slot_level)
    host = plan.host_bytes
    act_capacity = plan.host_budget - (host["total"] - host["saved activations"])
    times, rows = predict_step(
        plan.request,
        plan.sizes,
        plan.hardware,
        table,
        plan.window,
        plan.units,
        plan.rounds,
        plan.levels,
        plan.slot_level,
        act_capacity,
    )
    return dataclasses.replace(plan, table=table, times=times, policy_rows=tuple(rows))
