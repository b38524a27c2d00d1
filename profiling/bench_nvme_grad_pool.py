"""The pipeline's fp32 gradients with the NVMe tier: pooled per rank (the default) against one kept buffer
per sub-stage, interleaved (one process, schedule=sysx 4 stages x 2, bf16, speculate=always, threads engine).

Prints one JSON line per run: mean step seconds over 6 steps after 2, the optimizer's host bytes.
clip=1e-3 clips every step (each speculative step undone and re-stepped: the gradients converted again).

    .venv/bin/python profiling/bench_nvme_grad_pool.py
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

import sysx.runtime.optimizer as rank_optimizer
from sysx.config import EvalSection, LossScaleSection, ModelSection, OptimSection, SysxConfig, TrainSection
from sysx.data import TokenDataset, default_corpus_path
from sysx.runtime import PipelineOptions
from sysx.trainers.pipeline import PipelineTrainer


def config(nvme_dir: str, clip: float) -> SysxConfig:
    """A 12.8M-parameter model in bf16 with its optimizer states in ``nvme_dir``."""
    return SysxConfig(
        model=ModelSection(preset="tiny", dim=384, n_layers=8, n_heads=6, n_kv_heads=2, ffn_dim=1024),
        train=TrainSection(steps=8, micro_batch_size=2, micro_batches=2, seq_len=64),
        optim=OptimSection(
            lr=3e-4,
            warmup_steps=2,
            grad_clip=clip,
            speculate="always",
            offload="nvme",
            nvme_dir=nvme_dir,
            nvme_engine="threads",
        ),
        eval=EvalSection(every=0),
        device="cpu",
        precision="bf16",
        loss_scale=LossScaleSection(init=1.0),
    )


def run(dataset: TokenDataset, *, pool: bool, clip: float) -> dict[str, object]:
    """One run; ``pool`` False keeps a fp32 gradient buffer per sub-stage (as before the pool)."""
    opts = PipelineOptions(
        schedule="sysx", split=2, stages_per_rank=4, optim_backend="torch", rollback="undo", optimizer_workers=1
    )
    keep = mock.patch.object(rank_optimizer, "uses_grad_scratch", lambda *a, **k: False)
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(tempfile.TemporaryDirectory())
        if not pool:
            stack.enter_context(keep)
        t = stack.enter_context(PipelineTrainer(config(d, clip), opts, dataset=dataset))
        t.run(2)
        t0 = time.perf_counter()
        t.run(6)
        step_s = (time.perf_counter() - t0) / 6
        return {
            "pool": t.optimizer.scratch is not None,
            "clip": clip,
            "step_s": round(step_s, 3),
            "optimizer_host_bytes": t.optimizer.host_bytes()["optimizer"],
            "params": sum(s.numel for s in t.optimizer.stages.values()),
            "load": Path("/proc/loadavg").read_text().split()[:3],
        }


def main() -> None:
    torch.set_num_threads(1)
    dataset = TokenDataset(default_corpus_path())
    for _ in range(2):
        for clip in (1.0, 1e-3):
            for pool in (False, True):
                print(json.dumps(run(dataset, pool=pool, clip=clip)), flush=True)


if __name__ == "__main__":
    main()
