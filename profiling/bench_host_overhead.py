"""Where sysx's host time goes: us per executor op and per message, and sysx beside torch's pipelining.

Spawns 2 gloo ranks on this CPU (one thread each) and measures, on rank 0:

1. **Messages** (:func:`sysx.runtime.host_bench.measure_message_us`): tiny fp32 messages (8 values)
   between the two ranks, as a ping-pong (latency), a stream of posted isend/irecv, and one
   ``batch_isend_irecv``: us per message.
2. **Ops** (:func:`sysx.runtime.host_bench.measure_op_us`): sysx's ``gpipe``, ``1f1b`` and ``sysx`` on
   the dim-8 probe model (4 tokens per micro-batch, 8 micro-batches): the step's wall time per op of
   rank 0's list, and the median us of one op per kind.
3. **Steps**: the same tiny Llama (``model=tiny``, sysx's own layers, cut where sysx's schedule cuts
   them, the same seeded initial weights and the same batches) through sysx's ``gpipe``, ``1f1b``
   and ``sysx`` (``PipelineTrainer``, device=cpu, fp32; ``+keep``: ``schedule.keep_activations``) and through torch.distributed.pipelining's
   ``ScheduleGPipe`` and ``Schedule1F1B`` (``PipelineStage`` over sysx's blocks), each without and
   with activation checkpointing (``torch.utils.checkpoint`` around each block). Both sides step
   AdamW on the host with global-norm clipping (sysx: its CPU Adam, torch backend; torch:
   ``torch.optim.AdamW(fused=True)`` after one all-reduce of the squared norm) and all-reduce the
   loss. The variants are interleaved step by step (each round runs one step of every variant, a
   barrier before each); the step time is the slower rank's. Prints median ms/step and the ratio
   to torch's plain and checkpointed schedule of the same kind, and checks that every variant's
   first loss agrees (same model, same batch)::

    PYTHONPATH=. .venv/bin/python profiling/bench_host_overhead.py
    PYTHONPATH=. .venv/bin/python profiling/bench_host_overhead.py --rounds 30 --out profiling/results/host.jsonl
    PYTHONPATH=. .venv/bin/python profiling/bench_host_overhead.py --only steps --variants sysx:gpipe,torch:gpipe
    PYTHONPATH=. .venv/bin/python profiling/bench_host_overhead.py --profile sysx:gpipe   # cProfile of rank 0
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SYSX_VARIANTS = ("sysx:gpipe", "sysx:1f1b", "sysx:gpipe+keep", "sysx:1f1b+keep", "sysx:sysx")
TORCH_VARIANTS = ("torch:gpipe", "torch:1f1b", "torch:gpipe+ckpt", "torch:1f1b+ckpt")
VARIANTS = SYSX_VARIANTS + TORCH_VARIANTS
PARTS = ("messages", "ops", "steps")


# ------------------------------------------------------------------------------------------ worker
class TorchPipeline:
    """One of torch's pipelining schedules over sysx's layers, with sysx's weights and batches."""

    def __init__(self, variant: str, sysx_trainer: Any, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        from torch.utils.checkpoint import checkpoint

        from sysx.model import Block, build_layers

        kind, _, extra = variant.partition(":")[2].partition("+")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        partition, cfg = sysx_trainer.schedule.partition, sysx_trainer.model_cfg
        if partition.n_stages != self.world:
            raise SystemExit(f"{variant}: sysx cut the model into {partition.n_stages} stages for {self.world} ranks")
        span = partition.layers(self.rank)
        layers = build_layers(cfg, span.start, span.stop, seed=sysx_trainer.cfg.seed, init=sysx_trainer.layer_init())
        self.head = layers.pop() if span.stop == cfg.n_layers + 2 else None
        recompute = extra == "ckpt"

        class Stage(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = torch.nn.ModuleList(layers)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                for layer in self.layers:
                    if recompute and isinstance(layer, Block):
                        x = checkpoint(layer, x, use_reentrant=False)
                    else:
                        x = layer(x)
                return x

        self.module = Stage()
        self.n_micro = args.micro_batches
        head = self.head

        def loss_fn(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            assert head is not None
            return head(hidden, labels) / self.n_micro  # sysx's Head (chunked CE); the mean over micro-batches

        stage = PipelineStage(self.module, self.rank, self.world, torch.device("cpu"))
        make = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
        # scale_grads=False: the loss is already divided, also for the Head's weights outside the stage module
        self.schedule = make(stage, self.n_micro, loss_fn=loss_fn, scale_grads=False)
        self.params = [p for p in self.module.parameters()] + ([] if head is None else list(head.parameters()))
        o = sysx_trainer.cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=True
        )
        self.clip = o.grad_clip
        self.batch = sysx_trainer.executor.batch_fn
        self.step_index = 0

    def train_step(self) -> float:
        """One step: the schedule, the clipped AdamW step, the loss all-reduce; returns the mean loss."""
        import torch
        import torch.distributed as dist

        mbs = [self.batch(self.step_index, j, "train") for j in range(self.n_micro)]
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(torch.cat([ids for ids, _ in mbs]))
        else:
            self.schedule.step(target=torch.cat([labels for _, labels in mbs]), losses=losses)
        sq = torch.stack([p.grad.pow(2).sum() for p in self.params if p.grad is not None]).sum().double()
        total = torch.stack(
            [sq, torch.tensor(float(sum(x.detach() for x in losses)) if losses else 0.0, dtype=torch.float64)]
        )
        dist.all_reduce(total)
        norm = float(total[0].sqrt())
        if self.clip > 0 and norm > self.clip:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.clip / (norm + 1e-6))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_index += 1
        return float(total[1])


def _sysx_trainer(
    schedule: str, args: argparse.Namespace, info: Any, *, probe: bool = False, keep_activations: bool = False
) -> Any:
    from sysx.config import ModelSection
    from sysx.runtime import PipelineOptions
    from sysx.runtime.host_bench import probe_config, probe_model
    from sysx.trainers.pipeline import PipelineTrainer

    if probe:
        cfg = probe_config(probe_model(), micro_batches=8, micro_batch_size=1, seq_len=4)
    else:
        model = ModelSection(preset="tiny")
        cfg = probe_config(
            model, micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len
        )
    opts = PipelineOptions(schedule=schedule, optim_backend="torch", keep_activations=keep_activations)
    return PipelineTrainer(cfg, opts, info=info)


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _steps(args: argparse.Namespace, info: Any) -> dict[str, Any]:
    """Every variant, interleaved round by round; median ms per step and the first losses."""
    import torch.distributed as dist

    variants = args.variants.split(",")
    base = _sysx_trainer("gpipe", args, info)  # every torch variant takes its cut, weights and batches
    runners: dict[str, Callable[[], float]] = {}
    trainers = [base]
    for v in variants:
        if v.startswith("sysx:"):
            name, _, extra = v.split(":")[1].partition("+")
            t = base if v == "sysx:gpipe" else _sysx_trainer(name, args, info, keep_activations=extra == "keep")
            trainers += [t] if t is not base else []
            runners[v] = lambda t=t: t.train_step().loss
        else:
            runners[v] = TorchPipeline(v, base, args).train_step
    times: dict[str, list[float]] = {v: [] for v in variants}
    first: dict[str, float] = {}
    profiler = cProfile.Profile() if args.profile and info.rank == 0 else None
    try:
        for r in range(args.warmup + args.rounds):
            for v in variants:
                dist.barrier()
                on = profiler is not None and v == args.profile and r >= args.warmup
                if on:
                    profiler.enable()
                t0 = time.perf_counter()
                loss = runners[v]()
                elapsed = time.perf_counter() - t0
                if on:
                    profiler.disable()
                first.setdefault(v, loss)
                elapsed = _slowest(elapsed)
                if r >= args.warmup:
                    times[v].append(elapsed)
    finally:
        for t in trainers:
            t.close()
    out: dict[str, Any] = {"ms": {v: statistics.median(x) * 1e3 for v, x in times.items()}, "first_loss": first}
    out["all_ms"] = {v: [round(s * 1e3, 3) for s in x] for v, x in times.items()}
    if profiler is not None:
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(args.profile_rows)
        out["profile"] = stream.getvalue()
    return out


def worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    from sysx import dist as sdist
    from sysx.runtime.host_bench import measure_message_us, measure_op_us

    info = sdist.init(timeout_s=120.0)
    parts = args.only.split(",")
    args_row = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result: dict[str, Any] = {"load": os.getloadavg()[0], "args": args_row}
    if "messages" in parts:
        result["messages_us"] = measure_message_us(1 - info.rank)
    if "ops" in parts:
        result["ops_us"] = {}
        for schedule in ("gpipe", "1f1b", "sysx"):
            with _sysx_trainer(schedule, args, info, probe=True) as trainer:
                result["ops_us"][schedule] = measure_op_us(trainer, steps=args.op_steps)
    if "steps" in parts:
        result["steps"] = _steps(args, info)
    result["load_end"] = os.getloadavg()[0]
    if info.rank == 0:
        Path(args.result).write_text(json.dumps(result))
    sdist.shutdown()
    return 0


# ------------------------------------------------------------------------------------------ parent
def launch(argv: list[str], result: Path) -> None:
    """Start the 2 ranks (torchrun's environment) on ``argv``; wait for them."""
    from sysx.dist import free_port

    port, procs = free_port(), []
    try:
        for r in range(2):
            env = {k: v for k, v in os.environ.items() if k != "SYSX_JOB_ID"}
            env.update(
                RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            )
            cmd = [sys.executable, __file__, *argv, "--worker", "--result", str(result)]
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"bench_host_overhead: a rank failed (exit codes {codes}); see its output above")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)


def _ratio(ms: dict[str, float], v: str, ref: str) -> str:
    return f"{ms[v] / ms[ref]:.2f}x" if v in ms and ref in ms else "-"


def _steps_table(steps: dict[str, Any], a: dict[str, Any]) -> list[str]:
    """Median and best ms/step of every variant, each beside torch's plain and checkpointed schedule
    of its kind (sysx's own schedule beside GPipe's)."""
    ms, first = steps["ms"], steps["first_loss"]
    best = {v: min(x) for v, x in steps["all_ms"].items()}
    lines = [
        f"| tiny, 2 ranks, {a['micro_batches']} x {a['micro_batch_size']} x {a['seq_len']} tokens, "
        f"{a['rounds']} rounds | median ms/step | / torch plain | / torch ckpt | best ms/step | / torch plain "
        "| / torch ckpt | first loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in ms:
        kind = v.split(":")[1].split("+")[0]
        kind = kind if kind in ("gpipe", "1f1b") else "gpipe"
        plain, ckpt = f"torch:{kind}", f"torch:{kind}+ckpt"
        lines.append(
            f"| {v} | {ms[v]:.1f} | {_ratio(ms, v, plain)} | {_ratio(ms, v, ckpt)} | {best[v]:.1f} | "
            f"{_ratio(best, v, plain)} | {_ratio(best, v, ckpt)} | {first[v]:.6f} |"
        )
    return lines


def report(result: dict[str, Any]) -> str:
    """Markdown tables of one run."""
    lines = [f"load average at start {result['load']:.2f}, at end {result['load_end']:.2f}", ""]
    if "messages_us" in result:
        us = result["messages_us"]
        lines += ["| message (8 fp32, gloo) | median us per message | best round |", "|---|---:|---:|"]
        lines += [f"| {m} | {us[m]:.1f} | {us.get(m + ' best', float('nan')):.1f} |" for m in us if " " not in m]
        lines.append("")
    if "ops_us" in result:
        kinds = sorted({k for row in result["ops_us"].values() for k in row} - {"op", "op best", "step_ms", "ops"})
        lines += [
            "| probe schedule (dim 8, 8 x 1 x 4 tokens) | ops (rank 0) | ms/step | us/op | best us/op | "
            + " | ".join(f"{k} us" for k in kinds)
            + " |",
            "|---|---:|---:|---:|---:|" + "---:|" * len(kinds),
        ]
        for name, row in result["ops_us"].items():
            cells = " | ".join(f"{row[k]:.0f}" if k in row else "-" for k in kinds)
            best = row.get("op best", float("nan"))
            lines.append(
                f"| {name} | {row['ops']:.0f} | {row['step_ms']:.2f} | {row['op']:.0f} | {best:.0f} | {cells} |"
            )
        lines.append("")
    if "steps" in result:
        lines += _steps_table(result["steps"], result["args"])
        if "profile" in result["steps"]:
            lines += ["", "```", result["steps"]["profile"], "```"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"step variants of {VARIANTS}")
    parser.add_argument("--rounds", type=int, default=20, help="measured rounds (one step of every variant each)")
    parser.add_argument("--warmup", type=int, default=3, help="rounds not measured")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--op-steps", type=int, default=30, help="measured probe steps per schedule")
    parser.add_argument("--profile", default="", help="a variant whose measured steps rank 0 profiles (cProfile)")
    parser.add_argument("--profile-rows", type=int, default=30)
    parser.add_argument("--out", type=Path, help="append the raw result as one JSON line")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    bad = [v for v in args.variants.split(",") if v not in VARIANTS] + [
        p for p in args.only.split(",") if p not in PARTS
    ]
    if bad:
        raise SystemExit(f"unknown variant or part {bad}; variants: {', '.join(VARIANTS)}; parts: {', '.join(PARTS)}")
    argv = [a for a in sys.argv[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        launch(argv, path)
        result = json.loads(path.read_text())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
