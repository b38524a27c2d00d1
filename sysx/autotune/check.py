"""Prediction checked against measurement, every run (ProTrain's cost-model error, issue 14 item 4).

After the first steps a pipeline run (and ``schedule=single``) compares the iteration time and the
peak memory that :func:`~sysx.schedule.simulate.simulate` predicted for its schedule, fed with the
costs the run used, with what it measured; ``summary.json`` gets a ``"prediction"`` entry and the
log one line, plus a warning line when an error exceeds :data:`WARN_PCT`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import mean
from typing import Any

from sysx.autotune.replicas import landing_bytes
from sysx.schedule import Schedule
from sysx.schedule.costs import Costs, CostTable
from sysx.schedule.simulate import simulate

WARN_PCT = 10.0  # ProTrain reports under 4% on GPUs; a shared CPU is noisier
WARMUP_STEPS = 1  # the first step builds caches and connections: not measured
WINDOW_STEPS = 3  # steps measured after the warm-up at least (fewer when the run is shorter)
# seconds the measured steps span at least (fewer when the run is shorter): 3 steps of a tiny model
# (0.13 s each, a few of the kernel's time slices) scattered by +-7% between identical runs
WINDOW_S = 2.0
GPU, HOST = "peak_gpu_bytes", "peak_host_bytes"


@dataclass(frozen=True)
class Prediction:
    """The simulator's answer for one run: seconds per iteration and the peak memory of ``memory``
    (:data:`GPU` for the fullest rank, :data:`HOST` for all ranks together; "" for none)."""

    iteration_s: float
    peak_bytes: float
    memory: str
    source: str


def predict(
    schedule: Schedule, costs: Costs | CostTable, *, memory: str, source: str, gpus_per_node: int | None = None
) -> Prediction:
    """Simulate ``schedule`` with ``costs``; ``memory`` says which peak is compared (see :class:`Prediction`)."""
    table = costs if isinstance(costs, CostTable) else costs.table(schedule)
    tl = simulate(schedule, table, record=False, gpus_per_node=gpus_per_node)
    if memory == GPU:
        peak = max(tl.peak_gpu)
    elif memory == HOST:
        # every replica's ranks hold their own device buffers (host memory on a CPU "device") and
        # processes; the host state is sharded over the replicas (tl.host is one replica's share)
        # and the node's shared working copy counted once, as the check measures it (RunPrediction)
        peak = tl.replicas * (sum(tl.host) + sum(tl.peak_gpu)) + sum(tl.shm)
        if isinstance(costs, Costs):  # the landing buffers of the gradients (the node plan's "pinned")
            work = "float32" if costs.param_bytes == 4 else "bfloat16"
            ranks = schedule.n_ranks * tl.replicas
            peak += landing_bytes(schedule, costs.layer_params, tl.replicas, gpus_per_node or ranks, work_dtype=work)
    else:
        peak = 0.0
    return Prediction(tl.iteration, peak, memory, source)


def check_step(first_step: int, total_steps: int, recorded_last: int | None) -> int:
    """The step after which a run starting at ``first_step`` checks its prediction: the end of the
    recorded window when there is one, else after :data:`WINDOW_STEPS` steps past the warm-up."""
    if recorded_last is not None and first_step <= recorded_last < total_steps:
        return recorded_last
    return min(total_steps - 1, first_step + WARMUP_STEPS + WINDOW_STEPS - 1)


def long_enough(at: int, step_times: Sequence[tuple[int, float]], total_steps: int, slowest_s: float) -> int:
    """The check step once :func:`check_step`'s ``at`` is reached: ``at`` when its window spans
    :data:`WINDOW_S`, else the step at which as many more steps of ``slowest_s`` (the ranks' slowest
    mean step so far: every rank must reach the same answer) would span it, within the run."""
    kept = [t for s, t in step_times[WARMUP_STEPS:] if s <= at]
    if not kept or sum(kept) >= WINDOW_S:
        return at
    need = math.ceil(WINDOW_S / max(slowest_s, 1e-9))
    return max(at, min(total_steps - 1, at + need - len(kept)))


def measured_window(step_times: Sequence[tuple[int, float]]) -> tuple[list[int], float]:
    """``(steps, mean seconds)`` of the logged step times after the warm-up (all of them when the
    run has no step past it)."""
    kept = list(step_times[WARMUP_STEPS:]) or list(step_times)
    if not kept:
        raise ValueError("no step time was logged: nothing to compare the prediction with")
    return [s for s, _ in kept], mean(t for _, t in kept)


def _entry(predicted: float, measured: float) -> dict[str, float]:
    error = 100.0 * (measured / predicted - 1.0) if predicted > 0 else float("inf")
    return {"predicted": predicted, "measured": measured, "error_pct": error}


def compare(
    pred: Prediction, iteration_s: float, peak_bytes: float | None, *, steps: Sequence[int], measured_by: str
) -> tuple[dict[str, Any], list[str]]:
    """The ``prediction`` section of ``summary.json`` and the log lines (the last one a warning when
    an error exceeds :data:`WARN_PCT`). ``peak_bytes`` None: no memory was measured."""
    section: dict[str, Any] = {
        "source": pred.source,
        "measured_by": measured_by,
        "steps": [steps[0], steps[-1]],
        "iteration_s": _entry(pred.iteration_s, iteration_s),
    }
    if pred.memory and peak_bytes is not None:
        section[pred.memory] = _entry(pred.peak_bytes, peak_bytes)
    window = f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else f"{steps[0]}"
    it = section["iteration_s"]
    line = (
        f"prediction ({pred.source}): {it['predicted']:.4g} s/iteration, measured {it['measured']:.4g} s "
        f"({measured_by}, steps {window}): {it['error_pct']:+.1f}%"
    )
    if pred.memory in section:
        m = section[pred.memory]
        what = "peak GPU memory" if pred.memory == GPU else "peak host memory (all ranks)"
        line += (
            f"; {what} {m['predicted'] / 2**20:.1f} MiB, measured {m['measured'] / 2**20:.1f} MiB: "
            f"{m['error_pct']:+.1f}%"
        )
    lines = [line]
    off = [k for k in ("iteration_s", GPU, HOST) if k in section and abs(section[k]["error_pct"]) > WARN_PCT]
    if off:
        lines.append(
            f"warning: the prediction is off by more than {WARN_PCT:g}% ({', '.join(off)}): the costs "
            f"({pred.source}) do not describe this run (a busy machine, a shared VM whose speed moves "
            f"from run to run, or a stale profile: `sysx tune "
            f"--refresh` or single.hardware=remeasure measures this machine again)"
        )
    return section, lines
