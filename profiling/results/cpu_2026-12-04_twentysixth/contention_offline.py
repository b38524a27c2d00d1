"""tiny:2's plans with and without the node's CPU contention (host_contention.patch, tried and not kept;
issue 27, twenty-sixth session): from a tree with the patch applied and the profile ab_stages.sh uses,

    SYSX_CACHE_DIR=/tmp/s26/cache PYTHONPATH=. python profiling/results/cpu_2026-12-04_twentysixth/contention_offline.py

prints the search's time, its winner and the plans of the one- and two-stage layouts, the contention
charged and not (the tune's meeting, 6.4 ms, in place of its measurement)."""

from __future__ import annotations

import dataclasses
import importlib
import time

import torch

from sysx.autotune.apply import job_from_config
from sysx.autotune.cache import cached_profile
from sysx.autotune.search import Budget, search
from sysx.config.compose import load_config
from sysx.optim.cores import rank_cores

# the module, not the function sysx.schedule exports under its name
simulate_module = importlib.import_module("sysx.schedule.simulate")
OVERRIDES = ["model=tiny", "schedule=auto", "train.micro_batch_size=2", "train.micro_batches=8", "optim.backend=torch"]
cfg = load_config([*OVERRIDES, "train.seq_len=128", "device=cpu"])
job = dataclasses.replace(job_from_config(cfg, 2, 2, torch.device("cpu")), replicas=None)
profile = cached_profile(job.model, job.seq_len, torch.float32, torch.device("cpu"), rank_cores(2))
assert profile is not None, "no cached profile: run the tuned tiny:2 check first (see ab_stages.sh)"
profile = dataclasses.replace(profile, meeting_s=0.0064)
charged = simulate_module.host_contention
for name, fn in (("not charged", lambda *a, **k: 0.0), ("charged", charged)):
    simulate_module.host_contention = fn
    t0 = time.perf_counter()
    res = search(job, Budget(gpu=1e12, host=1e12, shm=1e12), profile)
    took = time.perf_counter() - t0
    best = res.fitting[0]
    print(f"contention {name}: search {took:.1f} s, winner {best.iteration * 1e3:.2f} ms `{best.label()}`")
    for c in res.fitting:
        o = c.options
        one_or_two = o.stages_per_rank in (1, 2) and o.param_buffers == o.stages_per_rank
        if (
            c.replicas == 2
            and o.cfg == 3
            and o.split == 1
            and c.micro_batch_size == 8
            and o.optimizer_workers == 1
            and one_or_two
        ):
            print(f"  stages_per_rank={o.stages_per_rank}: {c.iteration * 1e3:.2f} ms, {c.instructions} instructions")
