"""What checkpoints cost: size on disk, training stall per save, write time; peak host memory while
loading pretrained weights.

    python profiling/bench_checkpoint.py save [--dim 1024 --layers 8]     # a ~100M-parameter model
    python profiling/bench_checkpoint.py load [--dim 2048 --layers 18]    # a ~1B-parameter HF Llama

``save`` builds the sliding-window trainer (``schedule=single`` on this machine's device) for a
model of the given shape, trains 2 steps, then saves: once in the background (the stall is the
snapshot copy; the write runs on a thread) and once synchronously, and prints one Markdown table.
``load`` writes a random-weight Hugging Face Llama (bf16, sharded) with ``transformers`` in a child
process, then builds the trainer from it (``model.init_from``) in another child and reports that
child's peak RSS next to the size of its training state and of the weights, so "never held twice"
can be read off the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 1024**3


def _machine() -> str:
    flags = ""
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("model name"))
        simd = [f for f in ("avx512f", "avx2") if f" {f} " in cpu]
        flags = f"{model}, {simd[0] if simd else 'no avx2'}"
    except (OSError, StopIteration):
        flags = "unknown CPU"
    return f"{flags}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"


def _cfg(dim: int, layers: int, tmp: Path, **extra: str) -> list[str]:
    heads = max(1, dim // 128)
    return [
        f"model.dim={dim}",
        f"model.n_layers={layers}",
        f"model.n_heads={heads}",
        f"model.n_kv_heads={heads}",
        f"model.ffn_dim={int(dim * 8 / 3) // 64 * 64}",
        "train.seq_len=32",
        "train.micro_batch_size=1",
        "train.micro_batches=1",
        "eval.every=0",
        "single.print_plan=false",
        f"run_dir={tmp / 'run'}",
        *[f"{k}={v}" for k, v in extra.items()],
    ]


def bench_save(dim: int, layers: int) -> None:
    from sysx.config import load_config
    from sysx.trainers.checkpointing import JobCheckpoints
    from sysx.trainers.single import SingleTrainer

    with tempfile.TemporaryDirectory(dir=os.environ.get("SYSX_BENCH_DIR")) as d:
        tmp = Path(d)
        cfg = load_config(["schedule=single", *_cfg(dim, layers, tmp)])
        with SingleTrainer(cfg) as trainer:
            trainer.run(2)
            ckpts = JobCheckpoints(trainer)
            background = []
            for _ in range(2):  # the first save allocates the snapshot buffers, later saves reuse them
                t0 = time.perf_counter()
                report = ckpts.save(background=True)
                ckpts.saver.wait()
                background.append((report, time.perf_counter() - t0))
                trainer.run(1)
            t0 = time.perf_counter()
            sync = ckpts.save(background=False)
            sync_total = time.perf_counter() - t0
            ckpts.close()
            size = sum(p.stat().st_size for p in (tmp / "run" / "checkpoints" / "step-00000004").iterdir())
            n = trainer.n_params
    print(f"machine: {_machine()}; disk: {os.environ.get('SYSX_BENCH_DIR') or tempfile.gettempdir()}")
    print(f"model: dim {dim}, {layers} layers, {n / 1e6:.1f}M parameters; schedule=single, fp32\n")
    print("| save | checkpoint size | training stalled | save finished after |")
    print("| --- | --- | --- | --- |")
    for label, (report, total) in zip(("first", "later"), background):
        print(
            f"| background, {label} save (snapshot, then a thread writes) | {size / GiB:.2f} GiB | {report.stall_s:.3f} s "
            f"| {total:.2f} s |"
        )
    print(
        f"| synchronous (written before training goes on) | {size / GiB:.2f} GiB | {sync.stall_s:.3f} s | {sync_total:.2f} s |"
    )


_MAKE_HF = """
import sys, torch, transformers
dim, layers, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=dim, intermediate_size=int(dim * 8 / 3) // 64 * 64,
                               num_hidden_layers=layers, num_attention_heads=dim // 128, num_key_value_heads=dim // 128,
                               max_position_embeddings=2048, tie_word_embeddings=False)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(cfg)
model = model.to_empty(device="cpu").to(torch.bfloat16)
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.02)
model.save_pretrained(out, max_shard_size="2GB")
print(sum(p.numel() for p in model.parameters()))
"""

_LOAD = """
import json, resource, sys, torch
from sysx.config import load_config
from sysx.trainers.single import SingleTrainer
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cfg = load_config(sys.argv[1:])
with SingleTrainer(cfg) as t:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    state = sum(g.layout.numel for g in t.host.groups)
print(json.dumps({"before": before, "peak": peak, "params": state}))
"""


def bench_load(dim: int, layers: int) -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("SYSX_BENCH_DIR")) as d:
        hf = Path(d) / "hf"
        n = int(
            subprocess.run(
                [sys.executable, "-c", _MAKE_HF, str(dim), str(layers), str(hf)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split()[-1]
        )
        weights = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
        args = [
            "schedule=single",
            f"model.init_from={hf}",
            "train.seq_len=32",
            "train.micro_batch_size=1",
            "train.micro_batches=1",
            "eval.every=0",
            "single.print_plan=false",
            "data.name=default",
            f"run_dir={Path(d) / 'run'}",
            "single.device_memory_gb=4",
        ]
        out = subprocess.run([sys.executable, "-c", _LOAD, *args], check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
    state = 16 * r["params"]  # fp32 masters (= the working copy), fp32 gradients, Adam m and v
    print(f"machine: {_machine()}")
    print(
        f"HF Llama: dim {dim}, {layers} layers, {n / 1e9:.2f}B parameters, {weights / GiB:.2f} GiB of bf16 safetensors\n"
    )
    print(
        "| peak RSS of the process | RSS before building | training state (16 B/param) | weights (bf16) | peak - before - state |"
    )
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| {r['peak'] / GiB:.2f} GiB | {r['before'] / GiB:.2f} GiB | {state / GiB:.2f} GiB | {weights / GiB:.2f} GiB | "
        f"{(r['peak'] - r['before'] - state) / GiB:.2f} GiB |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("save", "load"))
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    a = p.parse_args()
    if a.what == "save":
        bench_save(a.dim or 1024, a.layers or 8)
    else:
        bench_load(a.dim or 2048, a.layers or 18)
    return 0


if __name__ == "__main__":
    sys.exit(main())
