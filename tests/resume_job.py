"""One rank of a multi-process resume run (started by tests/test_checkpoint_procs.py, not collected).

    RANK=.. WORLD_SIZE=.. ... python tests/resume_job.py SPEC.json OUT_DIR

SPEC: ``{"cfg": {section: fields}, "schedules": [PipelineOptions fields, ...], "phases": [[name, steps,
ckpt_dir, action, {section: fields} (optional)], ...]}``. For each schedule, in one process group, each
phase builds a fresh trainer (its config: ``cfg`` with the phase's sections' fields replaced, e.g.
``{"parallel": {"replicas": 2}}``; its schedule's options with those under ``"pipeline"``, e.g.
``{"pipeline": {"spread_last_step": False}}``), ``resume``s from the phase's checkpoint dir when
``action`` says so, ``dump``s the layer states it loaded (every rank: ``OUT_DIR/<schedule index>-<phase>-layers-<rank>.pt``,
the masters, moments and step counts it would save), trains ``steps`` steps and ``save``s; rank 0
writes ``OUT_DIR/<schedule index>-<phase>.pt`` with the step results, the full fp32 weights and every
rank's optimizer stages.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def make_config(fields: dict, checkpoint_dir: str):
    """A :class:`SysxConfig` from plain section dicts (the spec's ``cfg``), checkpoints in ``checkpoint_dir``."""
    import dataclasses

    from sysx.config import SysxConfig, validate

    sections = {f.name: f.default_factory for f in dataclasses.fields(SysxConfig) if callable(f.default_factory)}
    values = {k: sections[k](**v) if k in sections else v for k, v in fields.items()}
    cfg = SysxConfig(**values, run_dir=str(Path(checkpoint_dir).parent / "run"))
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=checkpoint_dir))
    validate(cfg)
    return cfg


def phase_fields(fields: dict, override: dict) -> dict:
    """``fields`` (section -> fields, or a top-level value) with ``override``'s fields and values replaced."""
    return {**fields, **{k: {**fields.get(k, {}), **v} if isinstance(v, dict) else v for k, v in override.items()}}


def layer_states(trainer) -> dict[int, dict]:
    """What this rank of ``trainer`` would save, read now: layer -> weight, exp_avg, exp_avg_sq, step."""
    out = {}
    for index, source in trainer.checkpoint_layers().items():
        state = source()
        out[index] = {k: getattr(state, k) for k in ("weight", "exp_avg", "exp_avg_sq", "step")}
    return out


def main(spec_path: str, out_dir: str) -> int:
    torch.set_num_threads(1)
    from sysx import dist as sdist
    from sysx.runtime import PipelineOptions
    from sysx.trainers.checkpointing import JobCheckpoints
    from sysx.trainers.pipeline import PipelineTrainer

    spec = json.loads(Path(spec_path).read_text())
    info = sdist.init(timeout_s=60)
    for index, options in enumerate(spec["schedules"]):
        for name, steps, ckpt_dir, action, *override in spec["phases"]:
            sections = dict(override[0]) if override else {}
            opts = PipelineOptions(**{"timeout_s": 60.0, **options, **sections.pop("pipeline", {})})
            phase_cfg = make_config(phase_fields(spec["cfg"], sections), f"{ckpt_dir}-{index}")
            with PipelineTrainer(phase_cfg, opts, info=info) as trainer:
                if phase_cfg.optim.offload == "nvme":  # the phase really runs on the tier's state files
                    assert all(s.store is not None for s in trainer.optimizer.stages.values()), name
                ckpts = JobCheckpoints(trainer)
                if "resume" in action:
                    assert ckpts.resume() is not None, f"phase {name}: nothing to resume in {ckpt_dir}-{index}"
                if "dump" in action:
                    torch.save(layer_states(trainer), Path(out_dir) / f"{index}-{name}-layers-{info.rank}.pt")
                results = trainer.run(steps)
                stages: list[list[str] | None] = [None] * info.world_size  # each rank's optimizer stages
                torch.distributed.all_gather_object(stages, sorted(s.name for s in trainer.optimizer.stages.values()))
                if "save" in action:
                    ckpts.save()
                ckpts.close()
                state = trainer.state_dict()
            if info.rank == 0:
                rows = [(r.step, repr(r.loss), repr(r.grad_norm), r.skipped, r.scale) for r in results]
                torch.save({"results": rows, "state": state, "stages": stages}, Path(out_dir) / f"{index}-{name}.pt")
    sdist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
