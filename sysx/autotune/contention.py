"""How much slower a layer runs inside the job than in the profile, measured by the job's ranks together.

The profile times each layer in one process, fastest of a few runs, while the job's other ranks
wait: on a CPU "device" that is not what a rank sees in the run, where every rank of the node (and
whatever else the machine runs at that moment) computes on the same cores. Measured here (issue
27): a tiny Block's forward + backward, 7.1 ms fastest alone, took 24 ms (median) on each of 2
processes run together on 2 cores at load 5, not the 7.1 ms the old core-count ratio
(:func:`sysx.autotune.costs.cpu_share`: 2 ranks / 2 cores = 1) predicted.

So at tune time every rank of the job times the same Block (the job's shape, one sequence) at the
same moment, as many runs as fit in :data:`WINDOW_S` (at least :data:`REPEATS`), :data:`WINDOWS`
times with a barrier before each, and reports the median window's wall time and CPU time per run;
rank 0 divides the slowest rank's wall time (:func:`slowdown`) and the ranks' mean CPU time
(:func:`cpu_ratio`) by the profile's time of that Block, and the search charges every layer time
and the executor's per-op host cost the slowdown, and the node's host lane
(:class:`~sysx.schedule.costs.HostLane`) each layer's CPU time.

Why a window and not the median of a few runs (issue 27): with more ranks than cores the kernel
shares a core in time slices of several milliseconds, longer than a tiny Block's 5 ms. A short run
mostly runs whole inside one slice and takes its solo time; the waits for the other ranks' slices
fall into a few long runs, which a median drops. The median of 7 runs read 1.07x for 4 ranks on 2
cores (they cannot run faster than 2x their solo time); only the throughput over a window many
slices long sees the sharing. Why several windows: inside a job a single window read 1.81-2.75x
for tiny at 4 ranks over 7 jobs, where the runs themselves showed 2.54-2.85x
(`profiling/RESULTS.md`, "CPU prediction check after posted receives look one pass ahead"); a window
disturbed by whatever else the job or the machine runs at that moment is dropped by the median (3
jobs then read 2.29-2.35x). The rates hold the machine's load at tune time; a load that changes
during the run moves the measurement and not the prediction. With a pipeline of several ranks per
replica the ranks idle in the bubbles and the factor overstates their contention a little.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from sysx.autotune.profile import MachineProfile
from sysx.model import ModelConfig
from sysx.model.llama import init_layer, make_layer

REPEATS = 7  # at least, after one warm-up
WINDOW_S = 0.3  # the runs' window at least: many of the kernel's time slices (a few ms each), so sharing shows
WINDOWS = 3  # windows timed, each after a barrier; the median is kept


def time_block_together(
    cfg: ModelConfig,
    seq_len: int,
    dtype: torch.dtype,
    *,
    repeats: int = REPEATS,
    window_s: float = WINDOW_S,
    windows: int = WINDOWS,
    barrier: Callable[[], object] | None = None,
) -> tuple[float, float]:
    """Mean seconds of one Block's no-grad forward plus its recompute-and-backward on one sequence,
    on the CPU, in wall-clock time and in this thread's CPU time, over at least ``repeats`` runs
    and ``window_s`` seconds, the median of ``windows`` such windows; ``barrier`` is called after
    the warm-up and between windows so every rank times each window at once."""
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
    timed = []
    for _ in range(windows):
        if barrier is not None:
            barrier()
        timed.append(mean_run_seconds(step, repeats=repeats, window_s=window_s))
    return statistics.median(w for w, _ in timed), statistics.median(c for _, c in timed)


def mean_run_seconds(step: Callable[[], object], *, repeats: int, window_s: float) -> tuple[float, float]:
    """``(wall, CPU)`` seconds per call of ``step`` over at least ``repeats`` calls and ``window_s``
    seconds: the window's totals over the calls, so the time slices the calls waited for count."""
    t0, c0 = time.perf_counter(), time.thread_time()
    runs = 0
    while runs < repeats or time.perf_counter() - t0 < window_s:
        step()
        runs += 1
    return (time.perf_counter() - t0) / runs, (time.thread_time() - c0) / runs


def slowdown(profile: MachineProfile, seq_len: int, together_s: list[float]) -> float:
    """The factor the job's layers run slower than the profile says: the slowest rank's time of the
    Block measured together (:func:`time_block_together`) over the profile's time of it (at least 1:
    the profile is the fastest the layer ran). The slowest, not the mean: ranks sharing cores do
    not share them evenly (4 on 2 cores: one rank's windows 1.03-1.12x the ranks' mean), and a step
    goes at its slowest rank's pace, since the ranks meet at every step's VALIDATE."""
    return _over_profile(profile, seq_len, together_s, "slowdown", of=max)


def cpu_ratio(profile: MachineProfile, seq_len: int, together_cpu_s: list[float]) -> float:
    """CPU seconds a layer costs per second of the profile's time of it: the ranks' mean CPU time of
    the Block measured together (:func:`time_block_together`) over the profile's fastest wall time
    (above 1 where the profile's fastest run was luckier than a typical one, or the ranks' cache
    sharing makes each pass do more work)."""
    return _over_profile(profile, seq_len, together_cpu_s, "cpu_ratio")


def _over_profile(
    profile: MachineProfile,
    seq_len: int,
    ranks_s: list[float],
    what: str,
    *,
    of: Callable[[list[float]], float] = statistics.fmean,
) -> float:
    """``of`` the ranks' seconds of the Block (their mean by default) over the profile's time of it, at least 1."""
    fwd, bwd = profile.layer_time("block", seq_len)
    if not ranks_s:
        raise ValueError(f"{what} needs at least one rank's time of the Block")
    return max(1.0, of(ranks_s) / max(fwd + bwd, 1e-12))
