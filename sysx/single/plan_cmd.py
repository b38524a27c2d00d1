"""``sysx plan-single``: print the single-GPU (AdaWS) plan for a model without training.

    sysx plan-single --model llama2_7b --seq-len 4096 --global-batch 64 --precision bf16 \\
        --hardware rtx4090 --device-gb 24 --host-gb 256

``--precision auto`` (the default) is what ``sysx-train`` trains in: bf16 on a GPU, fp32 on CPU.

``--hardware measure`` uses this machine's figures (its GPU, or its CPU standing in for one),
measured once per machine and cached with the autotune profile (``--refresh`` or ``--hardware
remeasure`` measures again); a preset
of :data:`sysx.config.choices.ASSUMED_HARDWARE` plans for a machine you are not on. The exit status is 0
for a plan, 2 when the budgets are refused (the message says how much is needed).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from sysx.config.choices import HARDWARE, OVERLAPS, PLACEMENTS, POLICIES, PRECISION_CHOICES
from sysx.machine.disk_plan import add_disk_arguments, disk_room, io_lines, largest_lines, resolve_disk, step_figures

if TYPE_CHECKING:
    from sysx.machine.hardware import HardwareProfile
    from sysx.single.plan_report import SinglePlan


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sysx plan-single", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="a preset of sysx.model.PRESETS (default tiny)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step (kept as given)")
    p.add_argument(
        "--precision",
        choices=PRECISION_CHOICES,
        default="auto",
        help="auto (default): as sysx-train resolves it, bf16 on a GPU (or a GPU preset), fp32 on CPU",
    )
    p.add_argument("--hardware", default="measure", choices=HARDWARE)
    p.add_argument("--refresh", action="store_true", help="measure this machine again instead of its cached figures")
    p.add_argument("--device-gb", type=float, default=0.0, help="device budget in GiB (0 = the device's free memory)")
    p.add_argument("--host-gb", type=float, default=0.0, help="host budget in GiB (0 = the host's free memory)")
    p.add_argument("--policy", default="dp", choices=POLICIES)
    p.add_argument("--compress", action="store_true", help="int8-compress offloaded activations")
    p.add_argument(
        "--keep-graph",
        action="store_true",
        help="when every block fits, keep each forward's autograd graph (single.keep_graph=true)",
    )
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--overlap", default="auto", choices=OVERLAPS)
    p.add_argument("--micro-batch-size", type=int, default=0)
    p.add_argument("--round-sequences", type=int, default=0)
    p.add_argument("--window", type=int, default=0)
    p.add_argument(
        "--seq-chunk", type=int, default=0, help="tokens per sequence chunk (0 = auto, seq-len = never chunk)"
    )
    p.add_argument(
        "--placement",
        default="cpu",
        choices=PLACEMENTS,
        help="also print the optimizer placement model's split (optim.placement; cpu: nothing)",
    )
    p.add_argument(
        "--cpu-adam-mparams",
        type=float,
        default=0.0,
        help="CPU Adam Mparams/s per worker for --placement (0 = measured on this machine)",
    )
    add_disk_arguments(p, host_flag=False)
    return p


def plan_precision(precision: str, hardware: str) -> str:
    """``--precision``, with ``auto`` resolved as a training job resolves ``precision=auto``
    (:func:`sysx.device.default_precision`) for the device planned for: this machine's (``measure``),
    or a GPU (every preset is one)."""
    if precision != "auto":
        return precision
    from sysx import device as dev

    planned = dev.resolve_device("auto") if hardware in ("measure", "remeasure") else "cuda"
    return dev.default_precision(planned)


def main(argv: list[str]) -> int:
    """Parse ``argv``, plan, print. Returns 0, or 2 when the plan is refused."""
    args = _parser().parse_args(argv)
    import torch

    from sysx.machine.hardware import GiB
    from sysx.model import get_preset
    from sysx.single.hardware import assumed_hardware, machine_hardware
    from sysx.single.plan_request import PlanError, PlanRequest
    from sysx.single.planner import make_plan

    precision = plan_precision(args.precision, args.hardware)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if args.hardware in ("measure", "remeasure"):
        hw = machine_hardware("remeasure" if args.refresh else args.hardware, dtype=dtype)
    else:
        hw = assumed_hardware(
            args.hardware, device_memory_gib=args.device_gb or None, host_memory_gib=args.host_gb or 256.0
        )
    try:
        model = get_preset(args.model)
        resolve_disk(args)
    except ValueError as err:
        print(f"sysx plan-single: {err}", file=sys.stderr)
        return 2
    req = PlanRequest(
        model=model,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        precision=precision,
        device_budget_bytes=int(args.device_gb * GiB) or None,
        host_budget_bytes=int(args.host_gb * GiB) or None,
        chunk=args.micro_batch_size,
        round_sequences=args.round_sequences,
        window=args.window,
        seq_chunk=args.seq_chunk,
        policy=args.policy,
        compress=args.compress,
        keep_graph=args.keep_graph,
        grad_clip=args.grad_clip,
        optimizer_overlap=args.overlap,
        offload=args.offload,
    )
    try:
        plan = make_plan(req, hw)
    except PlanError as err:
        print(f"sysx plan-single: refused: {err}", file=sys.stderr)
        return 2
    print(plan.render())
    for line in _tier_lines(args, plan, hw) if args.disk else []:
        print(line)
    if args.placement != "cpu":
        print(_placement_line(plan, args.placement, args.overlap != "forward", args.cpu_adam_mparams * 1e6))
    return 0


def _tier_lines(args: argparse.Namespace, plan: SinglePlan, hw: HardwareProfile) -> list[str]:
    """The NVMe tier's lines of the window's plan: state files, host memory with and without the tier,
    the exposed I/O per step and the global batch from which the disk hides (re-planned at twice the
    batch: the step grows with it, the I/O does not), the largest model this node holds."""
    import dataclasses

    from sysx.memory.budget import fmt_bytes, plan_host_memory
    from sysx.single.plan_request import PlanError
    from sysx.single.planner import make_plan

    req, n = plan.request, plan.sizes.total_params
    tier = plan_host_memory([(n, req.dtype)], offload="nvme")
    try:
        plain = fmt_bytes(make_plan(dataclasses.replace(req, offload="host"), hw).host_bytes["total"])
    except PlanError:
        plain = "refused: it does not fit"
    staging = plan.host_bytes.get("nvme staging", 0)
    step = (req.global_batch, plan.times["step_s"])
    try:  # the step at twice the batch (its growth per sequence)
        more = (2 * req.global_batch, make_plan(dataclasses.replace(req, global_batch=step[0] * 2), hw).times["step_s"])
    except PlanError as err:
        more, why = step, f"  the batch at which the disk hides is not planned: at twice the batch {err}"
    io, hide = step_figures(args.disk, tier.step_io, step, more)
    hiding = io_lines(io, hide, req.global_batch)
    if more is step:
        hiding[-1] = why
    return [
        f"NVMe tier (optim.offload=nvme), the drives: {args.disk.describe()}",
        f"  state files {fmt_bytes(tier.disk)}{disk_room(args.disk, tier.disk)}, host memory {fmt_bytes(plan.host_bytes['total'])} (without the tier "
        f"{plain}); per step read {fmt_bytes(tier.step_io)}, write {fmt_bytes(tier.step_io)}",
        *hiding,
        *largest_lines(args, str(req.dtype).removeprefix("torch."), args.disk, staging / n, window=True),
    ]


def _placement_line(plan: SinglePlan, mode: str, speculative: bool, cpu_params_per_s: float) -> str:
    """The window's optimizer split under ``optim.placement=mode`` (:mod:`sysx.single.lanes`); a
    preset's device counts as a separate processor."""
    from sysx.single.lanes import plan_groups, window_placement

    placed, units = window_placement(
        mode,
        plan,
        plan_groups(plan),
        separate_device=plan.hardware.kind == "cuda",
        speculative=speculative,
        cpu_params_per_s=cpu_params_per_s or None,
    )
    return f"optim.placement={mode}: {placed.describe(units, 'group')}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
