"""How much anonymous memory a process keeps after a training step beyond its state (issue 27, point 3).

Builds every layer of a model shape with its gradients allocated (the planned state), resets the
peak, runs two steps the way a pipeline rank does (forward without autograd, then recompute and
backward layer by layer) and prints the anonymous memory kept and the anonymous peak past the
start after each step. Each figure is taken twice: with glibc's default malloc and with
``MALLOC_MMAP_THRESHOLD_=131072`` (the dynamic mmap threshold off), so the difference is what the
heap keeps of the backward's freed workspace.

    PYTHONPATH=. python profiling/heap_retention.py [--dim 128 --layers 4 --ffn 352 --heads 4 --tokens 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import torch

from sysx.model import get_preset
from sysx.model.llama import init_layer, make_layer


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _anon_peak() -> int:
    return _status("VmHWM") - _status("RssFile") - _status("RssShmem")


def probe(dim: int, layers: int, ffn: int, heads: int, tokens: int) -> list[dict[str, float]]:
    """Per step: MiB of anonymous memory kept and the anonymous peak, both past the start."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(
        get_preset("tiny"), dim=dim, n_layers=layers, ffn_dim=ffn, n_heads=heads, n_kv_heads=heads
    )
    stack = [make_layer(cfg, i) for i in range(cfg.n_layers + 2)]
    for i, layer in enumerate(stack):
        init_layer(layer, i)
        for p in layer.parameters():
            p.grad = torch.zeros_like(p)  # the gradients are planned state: allocated before the peak reset
    ids = torch.randint(0, cfg.vocab_size, (1, tokens))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status("RssAnon")
    rows = []
    for _ in range(2):
        acts = [ids]
        with torch.no_grad():
            for layer in stack[:-1]:
                acts.append(layer(acts[-1]))
        grad = None
        for i in reversed(range(len(stack))):
            inp = acts[i] if i == 0 else acts[i].detach().requires_grad_(True)
            out = stack[i](inp, ids) if i == len(stack) - 1 else stack[i](inp)
            out.backward(grad)
            grad = inp.grad if i else None
        rows.append({"kept_mib": (_status("RssAnon") - start) / 2**20, "peak_mib": (_anon_peak() - start) / 2**20})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("dim", 128), ("layers", 4), ("ffn", 352), ("heads", 4), ("tokens", 256)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = [args.dim, args.layers, args.ffn, args.heads, args.tokens]
    if args.child:
        print(json.dumps(probe(*shape)))
        return
    argv = [sys.executable, __file__, "--child"] + [
        f"--{k}={v}" for k, v in zip(("dim", "layers", "ffn", "heads", "tokens"), shape)
    ]
    for label, extra in (
        ("default malloc", {}),
        ("MALLOC_MMAP_THRESHOLD_=131072", {"MALLOC_MMAP_THRESHOLD_": "131072"}),
    ):
        env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
        rows = json.loads(subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout)
        steps = ", ".join(
            f"step {i}: kept {r['kept_mib']:.1f} MiB, peak {r['peak_mib']:.1f} MiB" for i, r in enumerate(rows)
        )
        print(f"{label}: {steps}", flush=True)


if __name__ == "__main__":
    main()
