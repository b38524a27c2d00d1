"""What every trainer shares: config coercion, data checks, LR schedule, loss scaler, the step loop.

A trainer (reference loop, single-GPU sliding window, multi-process pipeline) implements
:meth:`Trainer.train_step` and :meth:`Trainer.evaluate`; everything around them is here, so every
schedule logs, evaluates and reports the same way, and a test can swap one trainer for another.
"""

from __future__ import annotations

import dataclasses
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from omegaconf import DictConfig, OmegaConf

from sysx import stopping
from sysx.checkpoint import Checkpoint
from sysx.checkpoint.pretrained import check_data_tokenizer, job_model_config
from sysx.checkpoint.saver import LayerSource
from sysx.checkpoint.trainer_state import rng_state, set_rng_state
from sysx.config import ConfigError, SysxConfig, to_yaml
from sysx.config.choices import EMULATED_DEVICE
from sysx.data.loss_weights import LossWeights
from sysx.metrics import RunLogger, StepResult
from sysx.model.llama import LayerInit, seed_init
from sysx.rank_env import env_rank

if TYPE_CHECKING:
    from sysx.data import TokenDataset
    from sysx.model import ModelConfig
    from sysx.optim.speculate import SpeculationPolicy


class StepHook(Protocol):
    """Called after every step, before it is logged (checkpoints record their stall on the result)."""

    def after_step(self, result: StepResult) -> None: ...


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


VAL_CARVE_FRACTION = 0.01  # of a file without a val split, when eval.every > 0


def open_dataset(cfg: SysxConfig, *, announce: bool = True) -> TokenDataset:
    """The token dataset of ``cfg.data``: the built-in stdlib corpus or ``data.path`` (ids checked on open).
    A file without a val split gets one carved from its end when ``eval.every > 0`` (``announce``: say so)."""
    from sysx.data import TokenDataset, check_samples_fit, default_corpus_path

    if cfg.data.name == "default":
        return TokenDataset(default_corpus_path())
    dataset = TokenDataset(str(cfg.data.path), dtype=cfg.data.dtype, vocab_size=cfg.data.vocab_size)
    if cfg.eval.every > 0:
        carved = dataset.carve_val(VAL_CARVE_FRACTION, min_tokens=8 * (cfg.train.seq_len + 1))
        if carved and announce:
            print(
                f"sysx-train: {dataset.path} has no val split; its last {carved} tokens are the val split "
                f"(eval.every={cfg.eval.every})",
                flush=True,
            )
    if dataset.has_loss_mask:  # samples are not packed or cut: every row must hold a whole one
        for split in dataset.splits:
            check_samples_fit(dataset, seq_len=cfg.train.seq_len, split=split)
    return dataset


def check_model_vocab(dataset: TokenDataset, model_cfg: ModelConfig) -> None:
    """The model's embedding must hold every id of the data: a :class:`ConfigError` naming the fix."""
    if dataset.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_cfg.vocab_size} is too small for the data (vocab_size "
            f"{dataset.vocab_size}); set model.vocab_size={dataset.vocab_size} or larger"
        )


def resolve_precision(cfg: SysxConfig, device: torch.device | str | None = None) -> SysxConfig:
    """``cfg`` with ``precision=auto`` replaced by the job device's default (:func:`sysx.device.default_precision`:
    bf16 on a GPU and an emulated one, fp32 on CPU), so the config written to ``run_dir`` and the logs say what ran."""
    if cfg.precision != "auto":
        return cfg
    if cfg.device == EMULATED_DEVICE:  # an emulated GPU trains in 16 bits, as the GPU it stands for would
        return dataclasses.replace(cfg, precision="bf16")
    from sysx import device as dev

    return dataclasses.replace(cfg, precision=dev.default_precision(job_device(cfg, device)))


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

    device: torch.device  # where the model computes: each trainer's __init__ decides it

    def __init__(
        self,
        cfg: SysxConfig | DictConfig,
        *,
        dataset: TokenDataset | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        from sysx.optim.loss_scaler import make_scaler

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_object(cfg)  # type: ignore[assignment]
        if not isinstance(cfg, SysxConfig):
            raise TypeError(f"{type(self).__name__} needs a SysxConfig, got {type(cfg).__name__}")
        cfg = resolve_precision(cfg, device)
        self.cfg: SysxConfig = cfg
        self.model_cfg = job_model_config(cfg)
        self.dtype = DTYPES[cfg.precision]
        self.dataset = (
            dataset if dataset is not None else open_dataset(cfg, announce=env_rank() == 0)
        )  # rank 0 prints the data notes
        check_model_vocab(self.dataset, self.model_cfg)
        check_data_tokenizer(cfg, self.dataset)
        if cfg.eval.every > 0 and "val" not in self.dataset.splits:
            raise ConfigError(
                f"eval.every={cfg.eval.every} needs a val split, but {cfg.data.path or 'the data'} has only "
                f"{', '.join(self.dataset.splits)}; set eval.every=0 or prepare the data with a val split"
            )
        s = cfg.loss_scale
        self.scaler = make_scaler(
            cfg.precision,
            init_scale=s.init,
            growth_factor=s.growth_factor,
            backoff_factor=s.backoff,
            growth_interval=s.growth_interval,
            min_scale=s.min,
        )
        self.step_index = 0
        self.rank, self.world = 0, 1  # a multi-process trainer sets its own
        self._tag = uuid.uuid4().hex[:12]

    @property
    def job_tag(self) -> str:
        """Names this run's checkpoint saves; the same on every rank of a job."""
        return self._tag

    def layer_init(self) -> LayerInit:
        """How fresh layers get their values: ``model.init_from``'s weights, else the seeded init."""
        if self.cfg.model.init_from is None:
            return seed_init(self.cfg.seed)
        from sysx.checkpoint.pretrained import open_pretrained, pretrained_init

        return pretrained_init(open_pretrained(self.cfg.model.init_from))

    def tokenizer_dir(self) -> Path | None:
        """The tokenizer files kept beside the token file (``sysx data prepare --tokenizer``), if any."""
        from sysx.data.tokenizer import kept_tokenizer_dir

        kept = kept_tokenizer_dir(self.dataset.path)
        return kept if kept.is_dir() else None

    # ------------------------------------------------------------------------------ checkpoints
    @property
    @abstractmethod
    def n_params(self) -> int:
        """Number of (distinct) parameters of the model."""

    @abstractmethod
    def checkpoint_layers(self) -> dict[int, LayerSource]:
        """The flat layers this rank owns (weights, Adam moments, step count), as sources read at save time."""

    @abstractmethod
    def restore_layers(self, ckpt: Checkpoint) -> None:
        """Load the layers this rank owns from ``ckpt`` (weights, moments, step counts) into place."""

    def speculation_policy(self) -> SpeculationPolicy | None:
        """The policy deciding whether a step speculates (``optim.speculate``), if this trainer has one."""
        return None

    def training_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the layers (written by rank 0). With a speculation policy,
        its state too: an undone speculative step is exact only to an ulp (``rollback=undo``), so a
        resumed run must choose as the uninterrupted one would, whichever trainer resumes it."""
        state = {
            "step": self.step_index,
            "scaler": self.scaler.state_dict(),
            "rng": rng_state(),
            "config": to_yaml(self.cfg),
        }
        policy = self.speculation_policy()
        if policy is not None:
            state["speculation"] = policy.state_dict()
        return state

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        """Continue from ``ckpt``: its model must be this model; restores layers, scaler, RNG, step."""
        mismatch = ckpt.model_mismatch(dataclasses.asdict(self.model_cfg))
        if mismatch:
            raise ConfigError(
                f"train.resume={ckpt.path}: {mismatch}; resume with the same model, or set "
                f"train.resume=none (or another checkpoint.dir) to start fresh"
            )
        state = ckpt.trainer_state()
        self.restore_layers(ckpt)
        self.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        policy = self.speculation_policy()
        if policy is not None and "speculation" in state:
            policy.load_state_dict(state["speculation"])
        self.step_index = ckpt.step

    @property
    def tokens_per_step(self) -> int:
        """Tokens one step trains on."""
        return self.cfg.tokens_per_step

    def lr_at(self, step: int) -> float:
        """The learning rate of ``step`` (warmup then cosine, over ``train.steps``)."""
        from sysx.optim.lr_schedule import lr_at

        o = self.cfg.optim
        return lr_at(step, lr=o.lr, warmup_steps=o.warmup_steps, total_steps=self.cfg.train.steps, min_lr=o.final_lr)

    def loss_weights(self, step: int, pieces: int, rows: int, *, split: str = "train") -> LossWeights:
        """How ``pieces`` loss pieces over the first ``rows`` rows of ``step`` add up to its loss
        (:mod:`sysx.data.loss_weights`)."""
        return LossWeights.of_step(
            self.dataset,
            pieces=pieces,
            seed=self.cfg.seed,
            step=step,
            rows_per_step=rows,
            seq_len=self.cfg.train.seq_len,
            split=split,
        )

    @abstractmethod
    def train_step(self) -> StepResult:
        """Run step ``self.step_index`` (forward, backward, optimizer) and advance the index."""

    @abstractmethod
    def evaluate(self, batches: int | None = None) -> float:
        """Mean loss over ``batches`` (default ``eval.batches``) micro-batches of the val split."""

    def measurements(self) -> dict[str, Any]:
        """Sections this trainer adds to ``summary.json`` (a recorded timeline's ``measured`` and ``plan``)."""
        return {}

    def stop_agreed(self) -> bool:
        """Whether every rank knows of the pending stop, so that all end the loop after the same step
        (one process: always). A signal that came after the step's all-reduce is carried by the next."""
        return True

    def finish_pending(self) -> None:  # noqa: B027 - a hook: a trainer without background work keeps it empty
        """Wait for work a step left running in the background (optimizer threads)."""

    def run(
        self,
        steps: int | None = None,
        *,
        logger: RunLogger | None = None,
        on_step: Callable[[StepResult], None] | None = None,
        hook: StepHook | None = None,
    ) -> list[StepResult]:
        """Train ``steps`` more steps (default ``train.steps``).

        With ``eval.every > 0`` the val loss is measured after steps ``0, every, 2*every, ...`` and
        the last step (``result.val_loss``). Each result goes to ``hook``, ``logger`` and ``on_step``.
        A stop deferred to the end of the step (:func:`sysx.stopping.deferring`) ends the loop early.
        """
        steps = self.cfg.train.steps if steps is None else steps
        every = self.cfg.eval.every
        results = []
        for _ in range(steps):
            result = self.train_step()
            if every > 0 and (result.step % every == 0 or result.step + 1 == self.cfg.train.steps):
                result.val_loss = self.evaluate()
            if hook is not None:
                hook.after_step(result)
            results.append(result)
            if logger is not None:
                logger.log(result)
            if on_step is not None:
                on_step(result)
            if stopping.pending() is not None and self.stop_agreed():
                break
        self.finish_pending()
        return results

    def close(self) -> None:  # noqa: B027 - a hook: a trainer holding nothing keeps it empty
        """Release threads, shared memory and process-group resources (idempotent)."""

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
