"""Where a pipeline rank's host memory goes past its baseline (issue 27, twenty-first session).

Runs ``sysx.train`` on every rank with one probe:

- ``parts``: at the prediction check, each rank's measured growth and (rank 0) the simulator's
  per-rank terms of the plan;
- ``steps``: each rank's growth after the trainer's build and after each of the first 14 steps;
- ``runtime``: each rank's growth after each part of ``RankRuntime``'s build.

    SYSX_CACHE_DIR=<a cache with the model's profile> OMP_NUM_THREADS=1 PYTHONPATH=. \\
    python -m sysx.launch --standalone --nproc_per_node=2 \\
      profiling/results/cpu_2026-12-03_twentyfirst/rank_host_probe.py PROBE schedule=sysx ... schedule.tune=false
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

import sysx.autotune.check as check
import sysx.runtime.rank as rank_runtime
import sysx.trainers.pipeline as pipeline
import sysx.trainers.prediction as prediction
from sysx.schedule.simulate import simulate
from sysx.train import main as train_main

MIB = 2**20
BASE: dict[str, int] = {}


def say(what: str) -> None:
    print(
        f"PROBE rank {dist.get_rank()} {what}: growth {prediction.host_growth(BASE['rss0']) / MIB:.2f} MiB", flush=True
    )


def keep_baseline() -> None:
    start = pipeline.start_host_peak

    def start_host_peak(*a: Any, **kw: Any) -> int:
        BASE["rss0"] = start(*a, **kw)
        return BASE["rss0"]

    pipeline.start_host_peak = start_host_peak


def parts() -> None:
    peak, predict = prediction.RunPrediction._peak, check.predict

    def _peak(self: prediction.RunPrediction) -> float | None:
        say("at the check")
        return peak(self)

    def plan(schedule: Any, costs: Any, *, memory: str, source: str, gpus_per_node: int | None = None) -> Any:
        table = costs if isinstance(costs, check.CostTable) else costs.table(schedule)
        tl = simulate(schedule, table, record=False, gpus_per_node=gpus_per_node)
        print(
            f"PROBE plan: replicas {tl.replicas}, host a rank {[round(h / MIB, 2) for h in tl.host]}, "
            f"device buffers a rank {[round(g / MIB, 2) for g in tl.peak_gpu]}, shared {[round(x / MIB, 2) for x in tl.shm]}, "
            f"process {table.process_bytes / MIB:.2f} MiB",
            flush=True,
        )
        return predict(schedule, costs, memory=memory, source=source, gpus_per_node=gpus_per_node)

    prediction.RunPrediction._peak = _peak  # type: ignore[method-assign]
    prediction.predict = plan


def steps() -> None:
    init, after = prediction.RunPrediction.__init__, prediction.RunPrediction.after_step

    def __init__(self: prediction.RunPrediction, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        say("built")

    def after_step(self: prediction.RunPrediction, result: Any) -> None:
        if result.step < 14:
            say(f"step {result.step}")
        after(self, result)

    prediction.RunPrediction.__init__ = __init__  # type: ignore[method-assign]
    prediction.RunPrediction.after_step = after_step  # type: ignore[method-assign]


def runtime() -> None:
    def wrap(owner: Any, name: str) -> None:
        built = getattr(owner, name)

        def then(*a: Any, **kw: Any) -> Any:
            out = built(*a, **kw)
            say(f"after {name}")
            return out

        setattr(owner, name, then)

    for name in ("_groups", "StageParams", "GradBuffers", "RankOptimizer", "Executor"):
        wrap(rank_runtime, name)
    for name in ("_pool", "_p2p"):
        wrap(rank_runtime.RankRuntime, name)


if __name__ == "__main__":
    keep_baseline()
    {"parts": parts, "steps": steps, "runtime": runtime}[sys.argv[1]]()
    sys.exit(train_main(sys.argv[2:]))
