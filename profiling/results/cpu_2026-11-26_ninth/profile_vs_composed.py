"""The profile's layer times summed against the same layers composed as a rank runs them (issue 27, point 3).

One process, the intra-op threads a rank of a ``ranks``-rank job gets, the tiny model (or the
check's 50M) at ``train.seq_len=128`` and ``mbs`` sequences a micro-batch, in milliseconds:

- ``profile``: :func:`sysx.autotune.profile.measure_profile`'s way, each layer kind the fastest of
  3 runs, summed over the model's layers (what the tuned plan starts from);
- ``layers, median``: each layer kind's median over 0.3 s, summed the same way;
- ``model, median``: the whole model in a row (Embedding, every Block, the Head) as a pipeline rank
  holding all of it runs a micro-batch, median over 1 s: the forward without autograd, the backward
  with its recompute from the input.

    PYTHONPATH=. python profiling/results/cpu_2026-11-26_ninth/profile_vs_composed.py tiny 8 2

It stands in for the sixth session's script of the same name, which was not kept.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

from profiling.check_predictions import MODELS
from sysx.autotune.profile import _layer_passes
from sysx.config import load_config, model_config
from sysx.machine.hardware import time_op
from sysx.model.llama import init_layer, make_layer
from sysx.optim.cores import intra_op_threads, rank_cores

SEQ = 128


def median_ms(fn: Callable[[], object], window_s: float = 1.0) -> float:
    """Median milliseconds of ``fn`` over ``window_s`` (at least 5 runs, after one warm-up)."""
    fn()
    runs: list[float] = []
    t_end = time.perf_counter() + window_s
    while len(runs) < 5 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e3


def main() -> None:
    model, mbs, ranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cfg = model_config(load_config([*MODELS[model], f"train.seq_len={SEQ}"]))
    layers = []
    for i in range(cfg.n_layers + 2):
        layer = make_layer(cfg, i)
        init_layer(layer, i)
        layers.append(layer)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (mbs, SEQ), generator=gen)
    hidden = torch.randn(mbs, SEQ, cfg.dim, generator=gen)
    cpu = torch.device("cpu")

    def forward(x: torch.Tensor) -> torch.Tensor:
        for layer in layers[:-1]:
            x = layer(x)
        return layers[-1](x, ids)

    def model_forward() -> None:
        with torch.no_grad():
            forward(ids)

    def model_backward() -> None:
        forward(ids).backward()

    with intra_op_threads(rank_cores(ranks)):
        kinds = {"embedding": (layers[0], 1), "block": (layers[1], cfg.n_layers), "head": (layers[-1], 1)}
        prof = [0.0, 0.0]
        each = [0.0, 0.0]
        for kind, (layer, count) in kinds.items():
            # the profile's way until 2026-12-02 (PROFILE_VERSION 8): each pass the fastest of 3
            t = _layer_passes(layer, kind, cfg, mbs, SEQ, cpu, torch.float32)
            prof[0] += count * time_op(t.forward, cpu, 3, fastest=True) * 1e3
            prof[1] += count * time_op(t.backward, cpu, 3, fastest=True) * 1e3
            x = ids if kind == "embedding" else hidden

            def fwd(layer: torch.nn.Module = layer, kind: str = kind, x: torch.Tensor = x) -> None:
                with torch.no_grad():
                    layer(x, ids) if kind == "head" else layer(x)

            def bwd(layer: torch.nn.Module = layer, kind: str = kind, x: torch.Tensor = x) -> None:
                inp = x if kind == "embedding" else x.detach().requires_grad_(True)
                out = layer(inp, ids) if kind == "head" else layer(inp)
                out.backward(None if kind == "head" else torch.ones_like(out))

            each[0] += count * median_ms(fwd, 0.3)
            each[1] += count * median_ms(bwd, 0.3)
        whole = (median_ms(model_forward, 1.0), median_ms(model_backward, 1.0))
    print(f"{model}, {mbs} x {SEQ} tokens, {rank_cores(ranks)} intra-op thread(s): forward / backward ms")
    print(f"  profile (fastest of 3, summed):  {prof[0]:7.2f} / {prof[1]:7.2f}")
    print(f"  layers, median over 0.3 s, summed: {each[0]:7.2f} / {each[1]:7.2f}")
    print(f"  model, median over 1 s:            {whole[0]:7.2f} / {whole[1]:7.2f}")


if __name__ == "__main__":
    main()
