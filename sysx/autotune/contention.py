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
rank 0 divides the ranks' mean wall time (:func:`slowdown`) and mean CPU time (:func:`cpu_ratio`)
by the profile's time of that Block, and the search charges every layer time and the executor's
per-op host cost the slowdown, and the node's host lane (:class:`~sysx.schedule.costs.HostLane`)
each layer's CPU time. Then the ranks run :data:`ROUNDS` rounds of about :data:`ROUND_S` of Blocks,
each ended as a step ends (:data:`STEP_END_COLLECTIVES` collectives, each after a hand-off to a
worker thread): what a round takes beyond the ranks' own compute is the meeting
(:func:`meeting_seconds`), charged once a step in place of a modelled latency of those collectives.

Why a meeting and not the slowest rank's window (issue 27): ranks sharing cores do not share them
evenly over a step's length. In a tiny job of 2 replicas (0.13 s steps), VALIDATE took 8 ms a step
where the plan had under 1 ms; timed inside it, the rank that arrived first waited 5-18 ms for the
other in most steps, a different rank from step to step. The slowest rank's 0.3 s window
(1.03-1.12x the mean for 4 ranks) sees only part of it: the rounds measured 3 ms a round for 2
ranks on 2 cores (0.11 s rounds) and 31 ms for 4 (0.23 s rounds), the 31.6 ms a recorded tiny:4
step spent in VALIDATE.

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

Why a round ends as a step ends (issue 27, twenty-fourth session): a replicated step's end is three
collectives one after another (the replicas' reduction barrier, VALIDATE's all-reduce, the end's
all-reduce), each after the rank handed work to or waited on its optimizer lane's thread. Ended by
one all-reduce the rounds charged tiny:2's plan 1.9 ms of meeting where its run spent 9.6 ms after
the later replica's last backward (1.3 ms of it the optimizer's step); ended as a step ends, 40 rounds
each on 2 cores read 9.2 ms against 8.2 ms at 2 ranks, 24.3 ms against 15.4 ms at 4 (the median
round; `profiling/results/cpu_2026-12-03_twentyfourth/meeting_shapes.py`). A pipeline of one
replica has no reduction barrier: its meeting is charged one collective too many.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from sysx.autotune.profile import MachineProfile
from sysx.machine.hardware import mean_run_seconds
from sysx.model import ModelConfig
from sysx.model.llama import init_layer, make_layer

REPEATS = 7  # at least, after one warm-up
WINDOW_S = 0.3  # the runs' window at least: many of the kernel's time slices (a few ms each), so sharing shows
WINDOWS = 3  # windows timed, each after a barrier; the median is kept
ROUND_S = 0.1  # a meeting round's compute: about the shortest steps a CPU job runs (tiny, 2 ranks: 0.13 s)
# meeting rounds timed; the median round is kept. Not 5: one round of two ranks read 4.6-13.8 ms
# between its quartiles (meeting_shapes.py), and five rounds' medians moved 1.8-9.9 ms over 11 tiny:2 jobs
ROUNDS = 9
STEP_END_COLLECTIVES = 3  # the replicas' reduction barrier, VALIDATE's all-reduce, the step end's


class Together(NamedTuple):
    """One rank's figures of :func:`time_block_together`: the Block's seconds (wall, CPU) and its
    meeting rounds ``(own compute, wall until the round's last collective returned)``."""

    wall: float
    cpu: float
    rounds: list[tuple[float, float]]


def time_block_together(
    cfg: ModelConfig,
    seq_len: int,
    dtype: torch.dtype,
    *,
    repeats: int = REPEATS,
    window_s: float = WINDOW_S,
    windows: int = WINDOWS,
    barrier: Callable[[], object] | None = None,
    meet: Callable[[float], float] | None = None,
    rounds: int = ROUNDS,
    round_s: float = ROUND_S,
) -> Together:
    """Mean seconds of one Block's no-grad forward plus its recompute-and-backward on one sequence,
    on the CPU, in wall-clock time and in this thread's CPU time, over at least ``repeats`` runs
    and ``window_s`` seconds, the median of ``windows`` such windows; ``barrier`` is called after
    the warm-up and between windows so every rank times each window at once. With ``meet`` (every
    rank's value in, their maximum out: an all-reduce), then ``rounds`` meeting rounds of about
    ``round_s`` of Blocks (:func:`meeting_rounds`)."""
    layer = make_layer(cfg, 1, dtype=dtype, device=torch.device("cpu"))
    init_layer(layer, 1)  # uninitialised memory can hold denormals, which time differently
    x = torch.randn(1, seq_len, cfg.dim, generator=torch.Generator().manual_seed(0)).to(dtype)

    def step() -> None:
        block_passes(layer, x)

    step()
    timed = []
    for _ in range(windows):
        if barrier is not None:
            barrier()
        timed.append(mean_run_seconds(step, repeats=repeats, window_s=window_s))
    wall, cpu = statistics.median(w for w, _ in timed), statistics.median(c for _, c in timed)
    met: list[tuple[float, float]] = []
    if meet is not None:
        slowest = meet(wall)  # every rank runs the same count of Blocks a round, as in a step
        per_round = max(1, round(round_s / max(slowest, 1e-9)))
        with ThreadPoolExecutor(1, thread_name_prefix="sysx-meeting") as lane:  # as the optimizer lane's thread

            def handoff() -> None:
                lane.submit(_nothing).result()

            met = meeting_rounds(step, per_round=per_round, rounds=rounds, meet=meet, handoff=handoff)
    return Together(wall, cpu, met)


def _nothing() -> None:
    """A hand-off's job: the round trip to the worker thread is what is timed."""


def block_passes(layer: torch.nn.Module, x: torch.Tensor) -> None:
    """One Block's passes as a rank runs them: the forward without autograd, then the backward with
    its recompute from the input (what :func:`time_block_together` times)."""
    with torch.no_grad():
        layer(x)
    inp = x.detach().requires_grad_(True)
    out = layer(inp)
    out.backward(torch.ones_like(out))


def meeting_rounds(
    step: Callable[[], object],
    *,
    per_round: int,
    rounds: int,
    meet: Callable[[float], float],
    handoff: Callable[[], object] = lambda: None,
) -> list[tuple[float, float]]:
    """``rounds`` rounds of ``per_round`` calls of ``step``, each ended as a step ends: ``handoff``
    then ``meet``, :data:`STEP_END_COLLECTIVES` times. Per round, the seconds of this rank's calls
    and the seconds until the last ``meet`` returned (the rounds run back to back, so a rank that
    waited starts its next round with the others). ``meet`` must block until every rank has called
    it, and every rank must run as many rounds (the counts are collective)."""
    meet(0.0)  # start together
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per_round):
            step()
        t1 = time.perf_counter()
        for _ in range(STEP_END_COLLECTIVES):
            handoff()
            meet(t1 - t0)
        out.append((t1 - t0, time.perf_counter() - t0))
    return out


def meeting_seconds(ranks_rounds: list[list[tuple[float, float]]]) -> float:
    """What a step's end costs beyond the ranks' compute: per round, the ranks' mean wall less their
    mean own compute (the waits for the slowest rank, the hand-offs and the step end's
    collectives), the median round; 0 for one rank or no rounds."""
    if len(ranks_rounds) < 2 or not all(ranks_rounds):
        return 0.0
    n = min(len(r) for r in ranks_rounds)
    per_round = [
        statistics.fmean(r[i][1] for r in ranks_rounds) - statistics.fmean(r[i][0] for r in ranks_rounds)
        for i in range(n)
    ]
    return max(0.0, statistics.median(per_round))


def slowdown(profile: MachineProfile, seq_len: int, together_s: list[float]) -> float:
    """The factor the job's layers run slower than the profile says: the ranks' mean time of the
    Block measured together (:func:`time_block_together`) over the profile's time of it (at least 1:
    a rank is not slower alone than with the others computing; below 1 is the machine's drift
    between the two timings). The mean: the uneven sharing between ranks, which
    makes a step wait for its slowest rank, is the meeting's (:func:`meeting_seconds`), measured
    at a step's length."""
    return _over_profile(profile, seq_len, together_s, "slowdown")


def cpu_ratio(profile: MachineProfile, seq_len: int, together_cpu_s: list[float]) -> float:
    """CPU seconds a layer costs per second of the profile's time of it: the ranks' mean CPU time of
    the Block measured together (:func:`time_block_together`) over the profile's wall time of it
    (above 1 where the ranks' cache sharing makes each pass do more work)."""
    return _over_profile(profile, seq_len, together_cpu_s, "cpu_ratio")


def _over_profile(
    profile: MachineProfile,
    seq_len: int,
    ranks_s: list[float],
    what: str,
) -> float:
    """The ranks' mean seconds of the Block over the profile's time of it, at least 1."""
    fwd, bwd = profile.layer_time("block", seq_len)
    if not ranks_s:
        raise ValueError(f"{what} needs at least one rank's time of the Block")
    return max(1.0, statistics.fmean(ranks_s) / max(fwd + bwd, 1e-12))
