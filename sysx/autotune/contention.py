"""How much slower a layer runs inside the job than in the profile, measured by the job's ranks together.

The profile times each layer in one process, fastest of a few runs, while the job's other ranks
wait: on a CPU "device" that is not what a rank sees in the run, where every rank of the node (and
whatever else the machine runs at that moment) computes on the same cores. Measured here (issue
27): a tiny Block's forward + backward, 7.1 ms fastest alone, took 24 ms (median) on each of 2
processes run together on 2 cores at load 5, not the 7.1 ms the old core-count ratio
(:func:`sysx.autotune.costs.cpu_share`: 2 ranks / 2 cores = 1) predicted.

So at tune time every rank of the job times the same Block (the job's shape, one sequence) at the
same moment, the median of a few runs each; rank 0 divides their mean by the profile's time of
that Block (:func:`slowdown`) and the search charges every layer time and the executor's per-op
host cost that factor. It holds the machine's load at tune time; a load that changes during the
run moves the measurement and not the prediction. With a pipeline of several ranks per replica
the ranks idle in the bubbles and the factor overstates their contention a little.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from sysx.autotune.profile import MachineProfile
from sysx.model import ModelConfig
from sysx.model.llama import init_layer, make_layer

REPEATS = 7  # after one warm-up; the median, so one descheduled run neither hides nor dominates


def time_block_together(
    cfg: ModelConfig,
    seq_len: int,
    dtype: torch.dtype,
    *,
    repeats: int = REPEATS,
    barrier: Callable[[], object] | None = None,
) -> float:
    """Median seconds of one Block's no-grad forward plus its recompute-and-backward on one sequence,
    on the CPU; ``barrier`` is called after the warm-up so every rank times at once."""
    layer = make_layer(cfg, 1, dtype=dtype, device=torch.device("cpu"))
    init_layer(layer, 1)  # uninitialised memory can hold denormals, which time differently
    x = torch.randn(1, seq_len, cfg.dim, generator=torch.Generator().manual_seed(0)).to(dtype)

    def step() -> None:
        with torch.no_grad():
            layer(x)
        inp = x.detach().requires_grad_(True)
        out = layer(inp)
        out.backward(torch.ones_like(out))

    step()
    if barrier is not None:
        barrier()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def slowdown(profile: MachineProfile, seq_len: int, together_s: list[float]) -> float:
    """The factor the job's layers run slower than the profile says: the ranks' mean time of the
    Block measured together (:func:`time_block_together`) over the profile's time of it (at least 1:
    the profile is the fastest the layer ran)."""
    fwd, bwd = profile.layer_time("block", seq_len)
    if not together_s:
        raise ValueError("slowdown needs at least one rank's time of the Block")
    return max(1.0, statistics.fmean(together_s) / max(fwd + bwd, 1e-12))
