"""``optim.placement`` for the sliding window: the inputs of :func:`sysx.optim.placement.choose`.

From the window's plan (:attr:`SinglePlan.times`, its hardware profile) and this machine's CPU Adam
rate: each group's unit (when its gradients are home, its ``due`` into the next forward), when the
device is idle, and both lanes' rates. On a CPU-only job ``auto`` keeps the CPU lane without measuring.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sysx.machine.hardware import HardwareProfile
from sysx.optim.placement import LaneRates, Placement, Unit, choose
from sysx.single.plan_report import SinglePlan

# the window's CPU Adam workers: one group's norms are taken while another steps (at most two fp32
# gradient temporaries)
WORKERS = 2


def window_units(plan: SinglePlan, groups: Sequence[tuple[str, int]], *, speculative: bool) -> tuple[list[Unit], float]:
    """``groups``: ``(name, numel)`` of the blocks in order, then the Embedding+Head; returns the
    units (ready times from the plan's step, see docs/architecture.md) and when the device falls idle."""
    *blocks, (static, static_numel) = groups
    t = plan.times
    n, step = len(blocks), float(t["step_s"])
    fwd = float(t["block_fwd_round_s"])
    bwd = max(step / max(plan.rounds, 1) - n * fwd, 0.0) / max(n, 1)
    start = step - n * bwd  # the last round's backward
    units = []
    for k, (name, numel) in enumerate(blocks):
        due = 0.0 if speculative else max(0, k - plan.window + 1) * fwd
        units.append(Unit(name, numel, start + (n - k) * bwd + float(t["t_grad_s"]), due))
    units.append(Unit(static, static_numel, step))
    return units, step


def plan_groups(plan: SinglePlan) -> list[tuple[str, int]]:
    """The window's groups as the trainer names them, with their parameters (from the plan's sizes)."""
    sizes = plan.sizes
    blocks = [(f"block{k}", sizes.block_params) for k in range(sizes.n_blocks)]
    return [*blocks, ("embedding+head", sizes.static_params)]


def window_rates(
    hw: HardwareProfile, plan: SinglePlan, *, workers: int, backend: str, cpu_params_per_s: float | None = None
) -> LaneRates:
    """The plan's copy and device-memory rates, the device memory the lane may use (the activation
    ring and what the working set leaves free), and the CPU lane's throughput per worker:
    ``cpu_params_per_s`` or this machine's whole optimizer job (the workers share the cores)."""
    from sysx.machine.adam_rate import optimizer_job_params_per_s

    per_worker = cpu_params_per_s
    if per_worker is None:
        # timed on a block-sized tensor (up to 16M elements): on 1M elements 16 OpenMP threads spend
        # the step starting up, which measured 0.13 G params/s on an H200 host that steps a block at
        # 3.9 G/s and sent every group to the device lane there (profiling/RESULTS.md, first GPU run)
        numel = min(max(plan.sizes.block_params, 1 << 20), 1 << 24)
        # the whole job, as the pipeline's profile times it: a 16-bit group's gradients converted
        # and their norms taken, the step, the working copy written (on an H200 host a 3.2M bf16
        # group's step took 20 ms on one thread, the Adam step alone 13)
        per_worker = (
            optimizer_job_params_per_s(
                numel, dtype=plan.request.dtype, threads=torch.get_num_threads(), backend=backend
            )
            / workers
        )
    h2d, d2h = hw.pageable_copy_rates  # the lane copies the groups' masters and moments, not page-locked
    return LaneRates(
        cpu_params_per_s=per_worker,
        cpu_workers=workers,
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        overlapped=False,  # sysx.optim.device_lane: synchronous copies, one group after another
        device_mem_bytes_per_s=hw.device_mem_bytes_per_s,
        device_free_bytes=float(plan.device_budget - plan.device_bytes["total"] + plan.device_bytes["activation ring"]),
    )


def window_placement(
    mode: str,
    plan: SinglePlan,
    groups: Sequence[tuple[str, int]],
    *,
    separate_device: bool,
    speculative: bool,
    backend: str = "auto",
    rates: LaneRates | None = None,
    cpu_params_per_s: float | None = None,
) -> tuple[Placement, list[Unit]]:
    """The window's groups placed under ``optim.placement=mode`` and the units placed;
    ``separate_device``: the device is not the host (a GPU); ``rates``: given instead of the
    plan's and the measured ones (``cpu_params_per_s``: given instead of the measured CPU Adam)."""
    units, idle = window_units(plan, groups, speculative=speculative)
    if not separate_device and mode in ("cpu", "auto"):  # the host is the device: no lane, nothing to price
        return Placement((), 0.0, 0.0, {}), units
    if rates is None:
        rates = window_rates(plan.hardware, plan, workers=WORKERS, backend=backend, cpu_params_per_s=cpu_params_per_s)
    return choose(mode, units, rates, device_idle=idle, speculative=speculative, separate_device=separate_device), units
