"""One rank of a replica rollback run (started by tests/test_replica_rollback.py, not collected).

    RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. LOCAL_WORLD_SIZE=.. ... python tests/replica_rollback_job.py SPEC.json OUT_DIR

SPEC: ``{"cfg": {section: fields}, "steps": S, "bad": [step, global rank, element], "runs": [[name,
{PipelineOptions fields}, {section: fields} (optional: the run's config changes)], ...]}``. For each
run, in one process group, a fresh trainer trains S steps (fp32 and bf16: up to the bad step, which
raises NonFiniteGradients after the rollback); at step ``bad`` the rank named writes inf into ``element`` of the landing buffer of its
first owned sub-stage (after the offload, before the reduction reads it: an overflow on one
replica's gradients only). Every rank writes ``OUT_DIR/<run>-<rank>.json``: the step results, its
optimizer's outcome of the bad step, and how its shards (fp32 master, Adam m and v, step count) and
its node's working copy of every unit it maps after the bad step compare with before it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

Unit = tuple[int, int]


def inject(trainer, step: int, rank: int, element: int) -> None:
    """Wrap ``trainer``'s offload notice: at ``step`` on ``rank``, inf into the first owned unit's landing buffer."""
    if trainer.rank != rank:
        return
    optimizer = trainer.optimizer
    unit = (trainer.params.owned()[0].stage, trainer.params.owned()[0].sub)
    offloaded = optimizer.offloaded

    def poisoned(key: Unit, event) -> None:
        if trainer.step_index == step and key == unit:
            event.synchronize()  # the copy to the host is done: the reducer reads what is written now
            optimizer.host_grads[key].view(-1)[element] = float("inf")
        offloaded(key, event)

    optimizer.offloaded = poisoned


def snapshot(trainer) -> tuple[dict[Unit, list], dict[Unit, torch.Tensor]]:
    """This rank's shards (master, m, v, step count) and its working copy of every unit it maps."""
    shards = {}
    for key, stage in trainer.optimizer.stages.items():
        adam = stage.optimizer
        with stage.resident():  # optim.offload=nvme: read from the tier's files
            shards[key] = [adam.param.clone(), adam.exp_avg.clone(), adam.exp_avg_sq.clone(), adam.step_count]
    return shards, {key: t.clone() for key, t in trainer.params.shared.items()}


def compare(before, after, trainer) -> dict:
    """How the state after the bad step compares with before it."""
    (shards0, shared0), (shards1, shared1) = before, after
    bit_equal, rel = True, 0.0
    for key, (*tensors0, steps0) in shards0.items():
        *tensors1, steps1 = shards1[key]
        bit_equal &= steps0 == steps1
        for x, y in zip(tensors0, tensors1):
            bit_equal &= torch.equal(x.view(torch.int32), y.view(torch.int32))
            rel = max(rel, float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)))
    mismatch = {f"{k[0]}.{k[1]}": int((shared0[k] != shared1[k]).sum()) for k in shared0}
    # the working copy of each owned shard is its master (cast): no stale shard after the rollback
    stale = 0
    for key, stage in trainer.optimizer.stages.items():
        cut = trainer.layout.shard(trainer.params.units[key].numel)
        stale += int((shared1[key][cut.start : cut.stop] != stage.master_copy().to(shared1[key].dtype)).sum())
    return {
        "steps": sorted({s for *_, s in shards1.values()}),
        "bit_equal": bit_equal,
        "max_rel_diff": rel,
        "shared_mismatch": mismatch,
        "shared_numel": {f"{k[0]}.{k[1]}": t.numel() for k, t in shared0.items()},
        "stale_working_copy": stale,
        "working_copy_sha1": {
            f"{k[0]}.{k[1]}": hashlib.sha1(
                t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()
            ).hexdigest()
            for k, t in shared1.items()
        },
    }


def train(trainer, steps: int, bad_step: int) -> tuple[list, dict]:
    """``steps`` steps of ``trainer``; the comparison of the bad step's state with before it. fp32
    and bf16 raise NonFiniteGradients at the bad step (after the rollback): the run stops there."""
    from sysx.optim.loss_scaler import NonFiniteGradients
    from sysx.runtime.executor import ExecutionError

    results: list = []
    row: dict = {}
    for step in range(steps):
        before = snapshot(trainer) if step == bad_step else None
        try:
            results.append(trainer.train_step())
        except ExecutionError as err:
            if before is None or not isinstance(err.__cause__, NonFiniteGradients):
                raise
            row = compare(before, snapshot(trainer), trainer)
            row.update(raised=True, reduction=trainer.layout.reduction)
            break
        if before is not None:
            outcome = trainer.optimizer.outcome
            row = compare(before, snapshot(trainer), trainer)
            row.update(overflow=outcome.overflow, undone=outcome.undone, reduction=trainer.layout.reduction)
    return results, row


def main(spec_path: str, out_dir: str) -> int:
    torch.set_num_threads(1)
    from resume_job import make_config, phase_fields

    from sysx import dist as sdist
    from sysx.runtime import PipelineOptions
    from sysx.trainers.pipeline import PipelineTrainer

    spec = json.loads(Path(spec_path).read_text())
    info = sdist.init(timeout_s=60)
    bad_step, bad_rank, element = spec["bad"]
    for name, options, *override in spec["runs"]:
        fields = phase_fields(spec["cfg"], override[0] if override else {})
        cfg = make_config(fields, str(Path(out_dir) / "unused-checkpoints"))
        opts = PipelineOptions(**{"timeout_s": 60.0, "optim_backend": "torch", **options})
        with PipelineTrainer(cfg, opts, info=info) as trainer:
            inject(trainer, bad_step, bad_rank, element)
            results, row = train(trainer, spec["steps"], bad_step)
        row.update(
            skipped=[r.skipped for r in results],
            scales=[r.scale for r in results],
            speculated=[r.speculated for r in results],
            rolled_back=[r.rolled_back for r in results],
            losses=[r.loss for r in results],
        )
        Path(out_dir, f"{name}-{info.rank}.json").write_text(json.dumps(row))
    sdist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
