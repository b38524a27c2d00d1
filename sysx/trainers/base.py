"""What every trainer shares: config coercion, data checks, LR schedule, loss scaler, the step loop.

A trainer (reference loop, single-GPU sliding window, multi-process pipeline) implements
:meth:`Trainer.train_step` and :meth:`Trainer.evaluate`; everything around them is here, so every
schedule logs, evaluates and reports the same way, and a test can swap one trainer for another.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig, OmegaConf

from sysx.config import ConfigError, SysxConfig, model_config
from sysx.metrics import RunLogger, StepResult, describe_run, prepare_run_dir

if TYPE_CHECKING:
    from sysx.data import TokenDataset

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def open_dataset(cfg: SysxConfig) -> TokenDataset:
    """The token dataset of ``cfg.data``: the built-in stdlib corpus or ``data.path``."""
    from sysx.data import TokenDataset, default_corpus_path

    if cfg.data.name == "default":
        return TokenDataset(default_corpus_path())
    return TokenDataset(str(cfg.data.path), dtype=cfg.data.dtype, vocab_size=cfg.data.vocab_size)


def job_device(cfg: SysxConfig, device: torch.device | str | None = None) -> torch.device:
    """``device`` if given, else ``cfg.device`` resolved (``auto``: cuda when present); a device that
    is not available here is a :class:`ConfigError`."""
    from sysx import device as dev

    if device is not None:
        return torch.device(device)
    try:
        return dev.resolve_device(cfg.device)
    except ValueError as err:
        raise ConfigError(str(err)) from None


class Trainer(ABC):
    """Base of every schedule's trainer: ``Trainer(cfg).run(steps)`` -> one StepResult per step.

    ``cfg`` is a :class:`SysxConfig` or a composed DictConfig; ``dataset`` may be shared with a
    test or another trainer (opened from ``cfg.data`` by default).
    """

    def __init__(self, cfg: SysxConfig | DictConfig, *, dataset: TokenDataset | None = None) -> None:
        from sysx.optim.loss_scaler import make_scaler

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_object(cfg)  # type: ignore[assignment]
        if not isinstance(cfg, SysxConfig):
            raise TypeError(f"{type(self).__name__} needs a SysxConfig, got {type(cfg).__name__}")
        self.cfg: SysxConfig = cfg
        self.model_cfg = model_config(cfg)
        self.dtype = DTYPES[cfg.precision]
        self.dataset = dataset if dataset is not None else open_dataset(cfg)
        if self.dataset.vocab_size > self.model_cfg.vocab_size:
            raise ConfigError(
                f"model.vocab_size={self.model_cfg.vocab_size} is too small for the data "
                f"(vocab_size {self.dataset.vocab_size}); set model.vocab_size={self.dataset.vocab_size} or larger"
            )
        if cfg.eval.every > 0 and "val" not in self.dataset.splits:
            raise ConfigError(
                f"eval.every={cfg.eval.every} needs a val split, but {cfg.data.path or 'the data'} has only "
                f"{', '.join(self.dataset.splits)}; set eval.every=0 or prepare the data with a val split"
            )
        s = cfg.loss_scale
        self.scaler = make_scaler(cfg.precision, init_scale=s.init, growth_factor=s.growth_factor,
                                  backoff_factor=s.backoff, growth_interval=s.growth_interval, min_scale=s.min)
        self.step_index = 0

    @property
    def tokens_per_step(self) -> int:
        """Tokens one step trains on."""
        return self.cfg.tokens_per_step

    def lr_at(self, step: int) -> float:
        """The learning rate of ``step`` (warmup then cosine, over ``train.steps``)."""
        from sysx.optim.lr_schedule import lr_at

        o = self.cfg.optim
        return lr_at(step, lr=o.lr, warmup_steps=o.warmup_steps, total_steps=self.cfg.train.steps, min_lr=o.min_lr)

    @abstractmethod
    def train_step(self) -> StepResult:
        """Run step ``self.step_index`` (forward, backward, optimizer) and advance the index."""

    @abstractmethod
    def evaluate(self, batches: int | None = None) -> float:
        """Mean loss over ``batches`` (default ``eval.batches``) micro-batches of the val split."""

    def finish_pending(self) -> None:
        """Wait for work a step left running in the background (optimizer threads)."""

    def run(self, steps: int | None = None, *, logger: RunLogger | None = None,
            on_step: Callable[[StepResult], None] | None = None) -> list[StepResult]:
        """Train ``steps`` more steps (default ``train.steps``).

        With ``eval.every > 0`` the val loss is measured after steps ``0, every, 2*every, ...`` and
        the last step (``result.val_loss``). Each result goes to ``logger`` and ``on_step``.
        """
        steps = self.cfg.train.steps if steps is None else steps
        every = self.cfg.eval.every
        results = []
        for _ in range(steps):
            result = self.train_step()
            if every > 0 and (result.step % every == 0 or result.step + 1 == self.cfg.train.steps):
                result.val_loss = self.evaluate()
            results.append(result)
            if logger is not None:
                logger.log(result)
            if on_step is not None:
                on_step(result)
        self.finish_pending()
        return results

    def close(self) -> None:
        """Release threads, shared memory and process-group resources (idempotent)."""

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_job(trainer: Trainer, *, is_main: bool = True, extra: str = "") -> int:
    """The body of every ``sysx-train`` job: describe the run, train with logging, close. Returns 0."""
    cfg = trainer.cfg
    try:
        run_dir = prepare_run_dir(cfg, is_main=is_main)
        if is_main:
            data = f"data {cfg.data.name} ({len(trainer.dataset.split('train'))} train tokens, vocab {trainer.dataset.vocab_size})"
            lines = [data] + ([extra] if extra else [])
            print(describe_run(cfg, n_params=trainer.n_params, device=trainer.device, extra="\n  ".join(lines)), flush=True)
        with RunLogger(run_dir if is_main else None, total_steps=cfg.train.steps, every=cfg.log.every,
                       progress=cfg.log.progress, device=trainer.device, enabled=is_main) as logger:
            trainer.run(cfg.train.steps, logger=logger)
            logger.close()
    finally:
        trainer.close()
    return 0
