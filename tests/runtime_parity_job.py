"""One rank of a multi-process parity run (started by tests/test_runtime_procs.py, not collected).

    RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. LOCAL_WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. \
        python tests/runtime_parity_job.py SPEC.json RESULT.json

SPEC: ``{"model": {...ModelSection fields}, "train": {...}, "steps": 3, "data": token file (optional), "optim": {...OptimSection
fields, optional}, "precision": (optional), "replicas": R (optional), "schedules": [{PipelineOptions fields, optional "optim": {...}}, ...]}`` (``optim_backend``
defaults to torch; an entry's "optim" overrides optim.* for it). Rank 0 trains the single-process reference in-process once; then every rank runs
each schedule in turn in the same process group (a fresh PipelineTrainer each, same seed and
batches), and rank 0 compares per-step losses, gradient norms and the final fp32 parameters with
the reference and writes the figures to RESULT.json. With ``replicas`` R the pipelines run as R
data-parallel replicas and the reference trains on R x ``train.micro_batches`` micro-batches: the
union of the replicas' batches of every step.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch


def main(spec_path: str, out_path: str) -> int:
    torch.set_num_threads(1)
    from sysx import dist as sdist
    from sysx.config import EvalSection, ModelSection, OptimSection, SysxConfig, TrainSection, validate
    from sysx.config.sections import ParallelSection
    from sysx.data import TokenDataset, default_corpus_path
    from sysx.runtime import PipelineOptions
    from sysx.trainers.pipeline import PipelineTrainer
    from sysx.trainers.reference import ReferenceTrainer

    spec = json.loads(Path(spec_path).read_text())
    info = sdist.init(timeout_s=float(spec.get("timeout_s", 60)))
    steps = int(spec["steps"])
    cfg = SysxConfig(
        model=ModelSection(**spec["model"]),
        train=TrainSection(steps=steps, **spec["train"]),
        optim=OptimSection(**spec.get("optim", {})),
        eval=EvalSection(every=0),
        device="cpu",
        seed=spec.get("seed", 0),
        precision=spec.get("precision", "auto"),
    )
    validate(cfg)
    replicas = int(spec.get("replicas", 1))
    ref_cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, micro_batches=replicas * cfg.train.micro_batches)
    )
    cfg = dataclasses.replace(cfg, parallel=ParallelSection(replicas=replicas))
    dataset = TokenDataset(spec.get("data") or default_corpus_path())
    ref_losses: list[float] = []
    ref_norms: list[float] = []
    ref_state: dict[str, torch.Tensor] = {}
    ref_norms64: list[float] = []
    if info.rank == 0:
        reference = ReferenceTrainer(ref_cfg, dataset=dataset)
        total_norm = torch.nn.utils.get_total_norm

        def recorded(grads: list[torch.Tensor], *args: object, **kwargs: object) -> torch.Tensor:
            # the reference clips with torch's fp32 norm (its rounding alone is ~1e-6 relative);
            # the exact norm of the same gradients is recorded beside it for tight comparisons
            ref_norms64.append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))))
            return total_norm(grads, *args, **kwargs)  # type: ignore[arg-type]

        torch.nn.utils.get_total_norm = recorded  # type: ignore[assignment]
        try:
            results = reference.run(steps)
        finally:
            torch.nn.utils.get_total_norm = total_norm
        ref_losses = [r.loss for r in results]
        ref_norms = [r.grad_norm for r in results]
        ref_state = reference.state_dict()
    rows = []
    first_state: dict[str, torch.Tensor] = {}
    for options in spec["schedules"]:
        t0 = time.perf_counter()
        # an entry's "optim" (e.g. {"speculate": "never"}) changes optim.* for that schedule only
        optim = {k: v for k, v in options.items() if k != "optim"}
        run_cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **options.get("optim", {})))
        opts = PipelineOptions(**{"optim_backend": "torch", "timeout_s": float(spec.get("timeout_s", 60)), **optim})
        with PipelineTrainer(run_cfg, opts, info=info, dataset=dataset) as trainer:
            results = trainer.run(steps)
            state = trainer.state_dict()
            sched = trainer.schedule
            mirrored = sum(u.mirrored for u in trainer.params.units.values())
            backends = sorted({s.optimizer.backend for s in trainer.optimizer.stages.values()})
            rollbacks = sorted({s.optimizer.rollback for s in trainer.optimizer.stages.values()})
            n_messages = sum(1 for ops in sched.ops for op in ops if op.kind.name.startswith("SEND"))
            stepped = {name: s.numel for name, s in ((s.name, s) for s in trainer.optimizer.stages.values())}
            every: list[dict[str, int] | None] = [None] * info.world_size
            if info.world_size > 1:
                torch.distributed.all_gather_object(every, stepped, group=trainer.group)
            else:
                every = [stepped]
        if info.rank != 0:
            continue
        first_state = first_state if rows else state
        losses = [r.loss for r in results]
        norms = [r.grad_norm for r in results]
        assert state.keys() == ref_state.keys(), (sorted(state)[:4], sorted(ref_state)[:4])
        a = torch.cat([ref_state[k].flatten() for k in ref_state])
        b = torch.cat([state[k].flatten() for k in ref_state])
        per_tensor = max(float((state[k] - v).norm() / v.norm()) for k, v in ref_state.items())
        rows.append(
            {
                "options": options,
                "n_stages": sched.n_stages,
                "split": sched.split,
                "ckpt": sched.options.ckpt,
                "keep_activations": sched.options.keep_activations,
                "optimizer": sched.options.optimizer,
                "backward_parts": sched.options.backward_parts,
                "messages_per_step": n_messages,
                "mirrored_units": mirrored,
                "losses": losses,
                "ref_losses": ref_losses,
                "lrs": [r.lr for r in results],
                "backends": backends,
                "rollbacks": rollbacks,
                "speculated": [r.speculated for r in results],
                "restepped": [r.restepped for r in results],
                "rolled_back": [r.rolled_back for r in results],
                "ref_norms": ref_norms,
                "norms": norms,
                "loss_rel": max(abs(x - y) / abs(y) for x, y in zip(losses, ref_losses)),
                "grad_norm_rel": max(abs(x - y) / abs(y) for x, y in zip(norms, ref_norms)),
                "grad_norm_rel_exact": max(abs(x - y) / abs(y) for x, y in zip(norms, ref_norms64)),
                "param_rel": float((a - b).norm() / a.norm()),
                "param_rel_per_tensor": per_tensor,
                "param_max_abs": float((a - b).abs().max()),
                # against the first entry's run (bit-for-bit layouts: 0.0)
                "vs_first_max_abs": max(float((state[k] - first_state[k]).abs().max()) for k in ref_state),
                "stepped_numels": every,  # each rank's optimizer stages: {name: elements stepped}
                "seconds": time.perf_counter() - t0,
            }
        )
        print(
            f"parity {options}: loss rel {rows[-1]['loss_rel']:.2e} param rel {rows[-1]['param_rel']:.2e} "
            f"({rows[-1]['seconds']:.1f} s)",
            flush=True,
        )
    if info.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": info.world_size, "nodes": info.num_nodes, "rows": rows}, f, indent=1)
    sdist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
