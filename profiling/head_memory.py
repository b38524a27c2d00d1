"""Peak host memory of the Head's loss, forward + backward: the full fp32 logits vs the chunked loss.

    python profiling/head_memory.py                       # vocab 128256, dim 256, 1024 and 2048 tokens, fp32 + bf16
    python profiling/head_memory.py --tokens 8192 --dtype bf16

Each measurement runs in a fresh process: inputs are made in place, then the peak resident set size
(``ru_maxrss``) grows by what the loss's forward + backward hold at once (the logits and their
gradients, the weight and hidden-state gradients). "full" is the path the Head used before
(``F.cross_entropy(lm_head(norm(h)).float())``), "chunked" is ``sysx.model.loss.chunked_cross_entropy``.
The full path grows with tokens x vocabulary; the chunked one by the gradients only.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

GiB = 2**30


def measure(mode: str, tokens: int, vocab: int, dim: int, dtype_name: str) -> dict[str, float]:
    """Run one forward + backward of the loss in this process; the peak RSS growth in bytes."""
    import torch
    import torch.nn.functional as F

    from sysx.model.layers import RMSNorm
    from sysx.model.loss import chunked_cross_entropy

    torch.set_num_threads(2)
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    hidden = torch.empty(tokens, dim, dtype=dtype).normal_().requires_grad_(True)
    weight = torch.empty(vocab, dim, dtype=dtype).normal_(0, 0.02).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,))
    norm = RMSNorm(dim, 1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if mode == "full":
        loss = F.cross_entropy(F.linear(norm(hidden), weight).float(), labels)
    else:
        loss = chunked_cross_entropy(hidden, weight, labels, features=norm)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grads = (weight.grad.numel() + hidden.grad.numel() + dim) * weight.element_size()
    return {"peak_growth_bytes": peak - before, "gradients_bytes": grads, "loss": float(loss)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dim", type=int, default=256, help="hidden width (the logits do not depend on it)")
    p.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--child", nargs=4, metavar=("MODE", "TOKENS", "VOCAB", "DIM_DTYPE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        mode, tokens, vocab, dim_dtype = args.child
        dim, dtype = dim_dtype.split(":")
        print(json.dumps(measure(mode, int(tokens), int(vocab), int(dim), dtype)))
        return 0
    print(f"vocab {args.vocab}, dim {args.dim}; peak RSS growth of forward + backward (gradients included)")
    for dtype in args.dtype:
        for tokens in args.tokens:
            row = []
            for mode in ("full", "chunked"):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", mode, str(tokens), str(args.vocab), f"{args.dim}:{dtype}"],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                r = json.loads(out)
                row.append(f"{mode} {r['peak_growth_bytes'] / GiB:6.2f} GiB (loss {r['loss']:.4f})")
            grads = r["gradients_bytes"] / GiB
            logits = tokens * args.vocab
            print(
                f"  {dtype} {tokens:6d} tokens ({logits / 1e6:.0f}M logits, gradients {grads:.2f} GiB): "
                + " | ".join(row)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
