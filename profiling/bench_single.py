"""Benchmark of ``schedule=single`` (issue 7, item 7): tokens/s, MFU and peak device memory.

For one model, sequence length and global batch (``micro_batch_size * micro_batches`` sequences)
and each device memory budget it times a few steps (warm-up steps excluded) of

* ``sysx single``: :class:`sysx.trainers.single.SingleTrainer` with ``single.device_memory_gb=<budget>``,
* ``pytorch ckpt``: plain PyTorch, the whole model on the device, full activation checkpointing
  (one ``torch.utils.checkpoint`` per Block), AdamW; "OOM" when it does not fit the budget,
* ``zero3 offload``: DeepSpeed ZeRO-3 with parameters and optimizer states offloaded to the CPU
  (CUDA only), the same checkpointed forward.

On CUDA every method runs under ``torch.cuda.set_per_process_memory_fraction(budget / total)``, so
the budget is enforced for all three. It prints the command line, then a Markdown table (pasteable
into ``profiling/RESULTS.md``); ``--json PATH`` also writes the rows. ``--long-context`` runs the
sequence lengths 8K..64K for the single trainer only. Example (CPU, a few seconds)::

    PYTHONPATH=. python profiling/bench_single.py --model tiny --seq-len 128 --micro-batch-size 4 \\
        --micro-batches 2 --steps 3 --warmup 1 --budgets-gb 1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sysx.config import SysxConfig, load_config, model_config
from sysx.device_memory import MemoryCap, device_usage, over_budget
from sysx.model import Block, build_model, flops_per_token, get_preset

GiB = 1 << 30
LONG_CONTEXT = (8192, 16384, 32768, 65536)
METHODS = ("sysx single", "pytorch ckpt", "zero3 offload")
# Dense peak TFLOP/s by the exact name torch.cuda.get_device_name() reports: (16-bit tensor cores,
# TF32 tensor cores, fp32 CUDA cores). Exact names: an H100 PCIe or NVL is not an H100 SXM.
GPU_PEAKS: dict[str, tuple[float, float, float]] = {
    "NVIDIA H100 80GB HBM3": (989.4, 494.7, 66.9),  # SXM5
    "NVIDIA H100 PCIe": (756.5, 378.0, 51.2),
    "NVIDIA H100 NVL": (835.5, 417.5, 60.0),
    "NVIDIA H200": (989.4, 494.7, 66.9),  # SXM
    "NVIDIA H200 NVL": (835.5, 417.5, 60.0),
    "NVIDIA A100-SXM4-80GB": (312.0, 156.0, 19.5),
    "NVIDIA A100-SXM4-40GB": (312.0, 156.0, 19.5),
    "NVIDIA A100 80GB PCIe": (312.0, 156.0, 19.5),
    "NVIDIA A100-PCIE-40GB": (312.0, 156.0, 19.5),
    "NVIDIA GeForce RTX 4090": (165.2, 82.6, 82.6),
}


def gpu_peak(name: str, precision: str, *, tf32: bool) -> float | None:
    """Dense peak TFLOP/s of the GPU called exactly ``name`` at ``precision`` (fp32 counts against
    the TF32 peak only when TF32 matmuls are enabled, else the fp32 CUDA-core peak); None when unknown."""
    peaks = GPU_PEAKS.get(name.strip())
    if peaks is None:
        return None
    half, tf32_peak, fp32 = peaks
    if precision != "fp32":
        return half
    return tf32_peak if tf32 else fp32


@dataclass
class Row:
    """One line of the table (also one JSON row)."""

    method: str
    model: str
    seq_len: int
    global_batch: int
    budget_gb: float
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    within_budget: bool | None = None
    note: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="tiny", help="a model preset (conf/model/*.yaml), e.g. tiny, llama2_7b, llama3_8b"
    )
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (global batch = product)")
    p.add_argument("--budgets-gb", default="8,16,24", help="comma-separated device memory budgets in GiB")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    p.add_argument(
        "--precision", default=None, choices=("fp32", "bf16", "fp16"), help="default: bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="device peak for MFU (default: looked up from the GPU name; required on other GPUs)",
    )
    p.add_argument(
        "--methods",
        default=",".join(m.split()[0] for m in METHODS),
        help="comma-separated subset of: sysx, pytorch, zero3",
    )
    p.add_argument(
        "--long-context",
        action="store_true",
        help=f"sequence lengths {','.join(map(str, LONG_CONTEXT))} for the single trainer only",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra sysx config override (repeatable), e.g. --set single.policy=pyao",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0 = torch's default); 1 avoids OpenMP spinning on a busy small CPU",
    )
    p.add_argument("--print-plan", action="store_true", help="let the single trainer print its plan")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="also write the rows as JSON")
    return p.parse_args(argv)


def peak_tflops(args: argparse.Namespace, precision: str) -> float | None:
    """The device peak for MFU: ``--peak-tflops``, else from the GPU's exact name; None on CPU."""
    if not torch.cuda.is_available():
        return args.peak_tflops
    if args.peak_tflops is not None:
        return args.peak_tflops
    name = torch.cuda.get_device_name()
    peak = gpu_peak(name, precision, tf32=torch.get_float32_matmul_precision() != "highest")
    if peak is None:
        raise SystemExit(
            f"bench_single: no peak known for GPU {name!r}: pass --peak-tflops (dense TFLOP/s at {precision})"
        )
    return peak


def make_config(args: argparse.Namespace, seq_len: int, budget_gb: float, precision: str) -> SysxConfig:
    """The sysx config of one benchmark point (eval off, LR schedule over the benchmark's steps)."""
    overrides = [
        f"model={args.model}",
        f"train.seq_len={seq_len}",
        f"train.micro_batch_size={args.micro_batch_size}",
        f"train.micro_batches={args.micro_batches}",
        f"train.steps={args.warmup + args.steps}",
        f"precision={precision}",
        "eval.every=0",
        f"single.device_memory_gb={budget_gb}",
        f"single.print_plan={str(args.print_plan).lower()}",
    ]
    if get_preset(args.model).max_seq_len < seq_len:  # long context: raise the RoPE table (before --set)
        overrides.append(f"model.max_seq_len={seq_len}")
    return load_config(overrides + list(args.overrides))


@contextlib.contextmanager
def device_budget(device: torch.device, budget_gb: float) -> Iterator[None]:
    """On CUDA: cap this process at ``budget_gb`` and reset the peak; restore the previous cap afterwards."""
    if device.type != "cuda":
        yield
        return
    gc.collect()
    torch.cuda.empty_cache()
    cap = MemoryCap(device, int(budget_gb * GiB))
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    finally:
        cap.close()
        gc.collect()
        torch.cuda.empty_cache()


def finish_row(row: Row, cfg: SysxConfig, device: torch.device, seconds: float, steps: int, peak: float | None) -> Row:
    """Fill tokens/s, MFU, peak memory and the budget check from a timed run of ``steps`` steps.

    The budget check is on what the cap limits (peak reserved memory) and on what the GPU gives up
    (this process's NVML usage, CUDA context included), not on the allocated peak alone."""
    tokens = cfg.tokens_per_step * steps
    row.tokens_per_s = tokens / seconds
    if peak is not None:
        row.mfu = row.tokens_per_s * flops_per_token(model_config(cfg), cfg.train.seq_len) / (peak * 1e12)
    usage = device_usage(device)
    if usage is not None:
        row.peak_gib = usage.peak_allocated / GiB
        over = over_budget(usage, int(row.budget_gb * GiB))
        row.within_budget = not over
        if over:
            row.note = (row.note + "; " if row.note else "") + "; ".join(over)
    return row


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_single(args: argparse.Namespace, cfg: SysxConfig, row: Row, peak: float | None) -> Row:
    """(a) the sliding-window trainer under ``single.device_memory_gb``."""
    from sysx.single.plan_request import PlanError
    from sysx.trainers.base import job_device
    from sysx.trainers.single import SingleTrainer

    device = job_device(cfg)
    with device_budget(device, row.budget_gb):
        try:
            trainer = SingleTrainer(cfg)
        except PlanError as err:
            row.note = f"plan refused: {str(err).splitlines()[0]}"
            return row
        try:
            trainer.run(args.warmup)
            sync(device)
            t0 = time.perf_counter()
            trainer.run(args.steps)  # waits for the pending optimizer steps at the end
            sync(device)
            seconds = time.perf_counter() - t0
            p = trainer.plan
            row.note = f"W={p.window}/{p.sizes.n_blocks} chunk={p.chunk}"
            return finish_row(row, cfg, device, seconds, args.steps, peak)
        except torch.cuda.OutOfMemoryError:
            row.note = "OOM"
            return row
        finally:
            trainer.close()


class CheckpointedLlama(nn.Module):
    """The flat layers with one activation checkpoint per Block; ``forward(x, y)`` is the loss."""

    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean token loss of ``y`` given ``x``."""
        h = self.layers[0](x)
        for layer in self.layers[1:-1]:
            assert isinstance(layer, Block)
            h = checkpoint(layer, h, use_reentrant=False)
        return self.layers[-1](h, y)


def batches(cfg: SysxConfig, step: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's micro-batches (the same sequences the sysx trainers see)."""
    from sysx.data import get_batch
    from sysx.trainers.base import open_dataset

    ds = open_dataset(cfg)
    t = cfg.train
    out = []
    for j in range(t.micro_batches):
        x, y = get_batch(
            ds, seed=cfg.seed, step=step, micro_batch=j, micro_batch_size=t.micro_batch_size, seq_len=t.seq_len
        )
        out.append((x.to(device), y.to(device)))
    return out


def run_pytorch(args: argparse.Namespace, cfg: SysxConfig, row: Row, peak: float | None) -> Row:
    """(b) plain PyTorch: fp32 weights and AdamW on the device, autocast for 16-bit, full checkpointing."""
    from sysx.trainers.base import DTYPES, job_device

    device = job_device(cfg)
    half = DTYPES[cfg.precision] if cfg.precision != "fp32" else None
    model = opt = None
    with device_budget(device, row.budget_gb):
        try:
            model = CheckpointedLlama(build_model(model_config(cfg), device=device, seed=cfg.seed).layers)
            o = cfg.optim
            opt = torch.optim.AdamW(
                model.parameters(), lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=o.eps, weight_decay=o.weight_decay
            )
            scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
            t0 = 0.0
            for step in range(args.warmup + args.steps):
                if step == args.warmup:
                    sync(device)
                    t0 = time.perf_counter()
                mbs = batches(cfg, step, device)
                for x, y in mbs:
                    with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
                        loss = model(x, y) / len(mbs)
                    scaler.scale(loss).backward()
                scaler.unscale_(opt)
                if o.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            sync(device)
            return finish_row(row, cfg, device, time.perf_counter() - t0, args.steps, peak)
        except torch.cuda.OutOfMemoryError:
            row.note = "OOM"
            if device.type == "cuda":
                row.peak_gib = torch.cuda.max_memory_allocated(device) / GiB
            return row
        finally:
            del model, opt


def zero3_config(cfg: SysxConfig) -> dict:
    """DeepSpeed config: ZeRO-3, parameters and optimizer states offloaded to pinned CPU memory."""
    o = cfg.optim
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.train.micro_batches,
        "gradient_clipping": o.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay},
        },
        "bf16": {"enabled": cfg.precision == "bf16"},
        "fp16": {"enabled": cfg.precision == "fp16"},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def run_zero3(args: argparse.Namespace, cfg: SysxConfig, row: Row, peak: float | None) -> Row:
    """(c) DeepSpeed ZeRO-3 with parameter and optimizer offload (ZeRO-Offload); CUDA only."""
    from sysx.trainers.base import job_device

    device = job_device(cfg)
    if device.type != "cuda":
        row.note = "needs CUDA"
        return row
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29511"),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(key, value)
    try:
        import deepspeed
    except ImportError as err:
        row.note = f"needs deepspeed ({err})"
        return row
    engine = None
    with device_budget(device, row.budget_gb):
        try:
            model = CheckpointedLlama(build_model(model_config(cfg), seed=cfg.seed).layers)
            engine, *_ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=zero3_config(cfg)
            )
            t0 = 0.0
            for step in range(args.warmup + args.steps):
                if step == args.warmup:
                    sync(device)
                    t0 = time.perf_counter()
                for x, y in batches(cfg, step, device):
                    loss = engine(x, y)
                    engine.backward(loss)
                    engine.step()  # an optimizer step at the gradient-accumulation boundary only
            sync(device)
            return finish_row(row, cfg, device, time.perf_counter() - t0, args.steps, peak)
        except torch.cuda.OutOfMemoryError:
            row.note = "OOM"
            row.peak_gib = torch.cuda.max_memory_allocated(device) / GiB
            return row
        finally:
            if engine is not None:
                engine.destroy()
            del engine


RUNNERS = {
    "sysx": ("sysx single", run_single),
    "pytorch": ("pytorch ckpt", run_pytorch),
    "zero3": ("zero3 offload", run_zero3),
}


def fmt(value: float | bool | None, spec: str) -> str:
    """A table cell: ``-`` for a missing value."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec)


def render(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    head = "| method | seq_len | global batch | budget GiB | tokens/s | MFU | peak GiB | within budget | note |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        mfu = None if r.mfu is None else 100.0 * r.mfu
        lines.append(
            f"| {r.method} | {r.seq_len} | {r.global_batch} | {r.budget_gb:g} | {fmt(r.tokens_per_s, '.0f')} | "
            f"{'-' if mfu is None else f'{mfu:.1f}%'} | {fmt(r.peak_gib, '.2f')} | "
            f"{fmt(r.within_budget, '')} | {r.note} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    """Run the benchmark, print the command and the table; return the rows."""
    args = parse_args(argv)
    shown = sys.argv if argv is None else ["profiling/bench_single.py", *argv]
    print("Command: `PYTHONPATH=. python " + " ".join(shlex.quote(a) for a in shown) + "`", flush=True)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    precision = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    peak = peak_tflops(args, precision)
    budgets = [float(b) for b in args.budgets_gb.split(",") if b.strip()]
    methods = ["sysx"] if args.long_context else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in RUNNERS]
    if unknown:
        raise SystemExit(f"bench_single: unknown --methods {','.join(unknown)}; allowed: {','.join(RUNNERS)}")
    seq_lens = list(LONG_CONTEXT) if args.long_context else [args.seq_len]
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(
        f"Device: {device_name}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads, precision {precision}, "
        f"peak {'-' if peak is None else f'{peak:g} TFLOP/s'}; {args.warmup} warm-up + {args.steps} timed steps",
        flush=True,
    )
    rows: list[Row] = []
    for seq_len in seq_lens:
        for budget in budgets:
            cfg = make_config(args, seq_len, budget, precision)
            for m in methods:
                name, runner = RUNNERS[m]
                row = Row(
                    method=name,
                    model=args.model,
                    seq_len=seq_len,
                    global_batch=args.micro_batch_size * args.micro_batches,
                    budget_gb=budget,
                )
                try:
                    rows.append(runner(args, cfg, row, peak))
                except Exception as err:  # one failing method must not hide the others' rows
                    row.note = f"error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                    rows.append(row)
                print(f"  done: {name} seq_len={seq_len} budget={budget:g} GiB {row.note}", file=sys.stderr, flush=True)
    print(render(rows), flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return rows


if __name__ == "__main__":
    main()
