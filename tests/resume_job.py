"""One rank of a multi-process resume run (started by tests/test_checkpoint_procs.py, not collected).

    RANK=.. WORLD_SIZE=.. ... python tests/resume_job.py SPEC.json OUT_DIR

SPEC: ``{"cfg": {section: fields}, "schedules": [PipelineOptions fields, ...], "phases": [[name, steps,
action], ...]}``. For each schedule, in one process group, each phase builds a fresh trainer,
``resume``s from the phase's checkpoint dir when ``action`` says so, trains ``steps`` steps and
``save``s; rank 0 writes ``OUT_DIR/<schedule index>-<phase>.pt`` with the step results and the
full fp32 weights.
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


def main(spec_path: str, out_dir: str) -> int:
    torch.set_num_threads(1)
    from sysx import dist as sdist
    from sysx.runtime import PipelineOptions
    from sysx.trainers.checkpointing import JobCheckpoints
    from sysx.trainers.pipeline import PipelineTrainer

    spec = json.loads(Path(spec_path).read_text())
    info = sdist.init(timeout_s=60)
    for index, options in enumerate(spec["schedules"]):
        opts = PipelineOptions(**{"timeout_s": 60.0, **options})
        for name, steps, ckpt_dir, action in spec["phases"]:
            phase_cfg = make_config(spec["cfg"], f"{ckpt_dir}-{index}")
            with PipelineTrainer(phase_cfg, opts, info=info) as trainer:
                ckpts = JobCheckpoints(trainer)
                if "resume" in action:
                    assert ckpts.resume() is not None, f"phase {name}: nothing to resume in {ckpt_dir}-{index}"
                results = trainer.run(steps)
                if "save" in action:
                    ckpts.save()
                ckpts.close()
                state = trainer.state_dict()
            if info.rank == 0:
                rows = [(r.step, repr(r.loss), repr(r.grad_norm), r.skipped, r.scale) for r in results]
                torch.save({"results": rows, "state": state}, Path(out_dir) / f"{index}-{name}.pt")
    sdist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
