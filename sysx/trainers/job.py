"""The body of every ``sysx-train`` job: resume, describe the run, train with logging and
checkpoints, save at the end, close. The trainers' ``train(cfg, info)`` functions call
:func:`run_job` once their trainer is built."""

from __future__ import annotations

from sysx.metrics import RunLogger, describe_run, prepare_run_dir
from sysx.trainers.base import Trainer
from sysx.trainers.checkpointing import JobCheckpoints


def run_job(trainer: Trainer, *, is_main: bool = True, extra: str = "") -> int:
    """Train ``trainer`` to ``train.steps`` (from the checkpoint ``train.resume`` finds, if any). Returns 0."""
    cfg = trainer.cfg
    checkpoints: JobCheckpoints | None = None
    try:
        run_dir = prepare_run_dir(cfg, is_main=is_main)
        checkpoints = JobCheckpoints(trainer)
        resumed = checkpoints.resume()
        if is_main:
            data = f"data {cfg.data.name} ({len(trainer.dataset.split('train'))} train tokens, vocab {trainer.dataset.vocab_size})"
            lines = [data] + ([extra] if extra else [])
            if cfg.model.init_from is not None:
                lines.append(f"weights from model.init_from={cfg.model.init_from}")
            if resumed is not None:
                lines.append(f"resumed from {resumed.path} at step {resumed.step}")
            print(describe_run(cfg, n_params=trainer.n_params, device=trainer.device, extra="\n  ".join(lines)), flush=True)
        with RunLogger(run_dir if is_main else None, total_steps=cfg.train.steps, every=cfg.log.every,
                       progress=cfg.log.progress, device=trainer.device, enabled=is_main,
                       first_step=trainer.step_index) as logger:
            trainer.run(cfg.train.steps - trainer.step_index, logger=logger, hook=checkpoints)
            checkpoints.finish(logger)
            logger.close()
    finally:
        try:
            if checkpoints is not None:
                checkpoints.close()
        finally:
            trainer.close()
    return 0
