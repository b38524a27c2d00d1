"""``schedule=reference``: a plain single-process PyTorch training loop.

This loop is the correctness reference for every other schedule, so it does nothing clever:

for each step ``s``:
  1. for each micro-batch ``j``: ``get_batch(dataset, seed, s, micro_batch=j)``, forward, and
     ``backward(loss_j / micro_batches * scale)`` (gradients accumulate);
  2. the gradients are turned into fp32 gradients of the fp32 weights (fp32: the parameters'
     own; bf16/fp16: the 16-bit gradients are converted to fp32 master gradients and divided by the
     loss scale), their global L2 norm is taken, and a non-finite norm means overflow;
  3. the loss scaler decides (fp16: skip the step and back off on overflow; fp32/bf16: a
     non-finite gradient is an error raised by the scaler);
  4. if not skipped: clip to ``optim.grad_clip`` by global norm (``clip_grad_norm_`` semantics),
     set ``lr_at(s)`` on the param groups, ``torch.optim.AdamW.step()``, and for 16-bit copy the
     fp32 masters back into the model's parameters.

Weight decay applies to every parameter (the pipeline runtimes step flat per-stage buffers, so
they cannot single out norms or embeddings either). The learning rate follows the step index
``s``, skipped or not, like the data. Master weights and Adam states live on the model's device.

Use it as a library: ``ReferenceTrainer(cfg).run(steps)`` returns one :class:`StepResult` per
step; :meth:`ReferenceTrainer.state_dict` gives the fp32 weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig, OmegaConf

from sysx import device as dev
from sysx.config import ConfigError, SysxConfig, model_config, resolve
from sysx.metrics import RunLogger, StepResult, describe_run, prepare_run_dir

if TYPE_CHECKING:
    from sysx.data import TokenDataset
    from sysx.dist import DistInfo
    from sysx.model import LlamaModel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def open_dataset(cfg: SysxConfig) -> TokenDataset:
    """The token dataset of ``cfg.data``: the built-in stdlib corpus or ``data.path``."""
    from sysx.data import TokenDataset, default_corpus_path

    if cfg.data.name == "default":
        return TokenDataset(default_corpus_path())
    return TokenDataset(str(cfg.data.path), dtype=cfg.data.dtype, vocab_size=cfg.data.vocab_size)


class ReferenceTrainer:
    """One process, one device, gradient accumulation, AdamW, fp32/bf16/fp16, clipping, warmup+cosine.

    ``cfg`` is a :class:`SysxConfig` (e.g. from :func:`sysx.config.load_config`) or a composed DictConfig.

    ``dataset`` and ``model`` (an fp32 :class:`LlamaModel`) may be given to share them with a test or
    another runtime; by default they are opened/built from ``cfg`` (``build_model(seed=cfg.seed)``).
    """

    def __init__(
        self,
        cfg: SysxConfig | DictConfig,
        *,
        dataset: TokenDataset | None = None,
        model: LlamaModel | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        from sysx.model import build_model
        from sysx.optim.loss_scaler import make_scaler

        if isinstance(cfg, DictConfig):  # a composed config (compose_config) instead of the dataclass
            cfg = OmegaConf.to_object(cfg)  # type: ignore[assignment]
        assert isinstance(cfg, SysxConfig), f"ReferenceTrainer needs a SysxConfig, got {type(cfg).__name__}"
        self.cfg = cfg
        self.model_cfg = model_config(cfg)
        try:
            self.device = dev.resolve_device(cfg.device) if device is None else torch.device(device)
        except ValueError as err:
            raise ConfigError(str(err)) from None
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

        fp32_model = model if model is not None else build_model(self.model_cfg, seed=cfg.seed)
        fp32_model = fp32_model.to(self.device)
        if self.dtype == torch.float32:
            self.model = fp32_model
            self.params = list(self.model.parameters())
            self.masters = self.params
        else:
            self.masters = [p.detach().clone() for p in fp32_model.parameters()]
            self.model = fp32_model.to(self.dtype)
            self.params = list(self.model.parameters())
        self._names = [name for name, _ in self.model.named_parameters()]

        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.masters, lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=o.eps, weight_decay=o.weight_decay
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

    # ------------------------------------------------------------------------------------ pieces
    @property
    def n_params(self) -> int:
        """Number of (distinct) parameters of the model."""
        return sum(p.numel() for p in self.params)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one step trains on."""
        return self.cfg.tokens_per_step

    def lr_at(self, step: int) -> float:
        """The learning rate of ``step`` (warmup then cosine, over ``train.steps``)."""
        from sysx.optim.lr_schedule import lr_at

        o = self.cfg.optim
        return lr_at(step, lr=o.lr, warmup_steps=o.warmup_steps, total_steps=self.cfg.train.steps, min_lr=o.min_lr)

    def batch(self, step: int, micro_batch: int, *, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of one micro-batch, on the trainer's device."""
        from sysx.data import get_batch

        t = self.cfg.train
        x, y = get_batch(
            self.dataset,
            seed=self.cfg.seed,
            step=step,
            micro_batch=micro_batch,
            micro_batch_size=t.micro_batch_size,
            seq_len=t.seq_len,
            split=split,
        )
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _master_grads(self, scale: float) -> list[torch.Tensor]:
        """fp32, unscaled gradients attached to the master weights (fp32: the parameters' own)."""
        if self.masters is self.params:
            return [p.grad for p in self.params if p.grad is not None]
        grads = []
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad = None
                continue
            g = p.grad.float()
            if scale != 1.0:
                g.div_(scale)
            m.grad = g
            grads.append(g)
        return grads

    # ------------------------------------------------------------------------------------- steps
    def train_step(self) -> StepResult:
        """Run one optimizer step (all micro-batches) and return what it did."""
        step = self.step_index
        n_mb = self.cfg.train.micro_batches
        t0 = time.perf_counter()
        scale = float(self.scaler.scale)
        for p in self.params:
            p.grad = None
        losses = []
        for j in range(n_mb):
            x, y = self.batch(step, j)
            loss = self.model.loss(x, y)
            losses.append(loss.detach().float())
            scaled = loss / n_mb
            if scale != 1.0:
                scaled = scaled * scale
            scaled.backward()

        grads = self._master_grads(scale)
        grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        found_inf = not bool(torch.isfinite(grad_norm))
        skipped = bool(self.scaler.update(found_inf))
        lr = self.lr_at(step)
        if not skipped:
            if self.cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self.masters, self.cfg.optim.grad_clip, grad_norm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            if self.masters is not self.params:
                with torch.no_grad():
                    for p, m in zip(self.params, self.masters):
                        p.copy_(m)
        for m in self.masters:
            m.grad = None
        loss_value = float(torch.stack(losses).mean())
        dev.synchronize(self.device)
        result = StepResult(
            step=step,
            loss=loss_value,
            lr=lr,
            grad_norm=float(grad_norm),
            skipped=skipped,
            scale=scale,
            tokens=self.tokens_per_step,
            step_time_s=time.perf_counter() - t0,
        )
        self.step_index += 1
        return result

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> float:
        """Mean loss over ``batches`` micro-batches of the val split (the same batches every time)."""
        n = self.cfg.eval.batches if batches is None else batches
        losses = [float(self.model.loss(*self.batch(0, j, split="val"))) for j in range(n)]
        return sum(losses) / len(losses)

    def run(
        self, steps: int | None = None, *, logger: RunLogger | None = None, on_step: Callable[[StepResult], None] | None = None
    ) -> list[StepResult]:
        """Train ``steps`` more steps (default ``train.steps``).

        With ``eval.every > 0`` the val loss is measured after steps ``0, every, 2*every, ...`` and the
        last step (``result.val_loss``). Each result goes to ``logger`` and ``on_step`` as it is made.
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
        return results

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 weights (the masters for 16-bit runs), by parameter name, detached copies."""
        return {name: m.detach().clone() for name, m in zip(self._names, self.masters)}


def check_single_process(info: DistInfo) -> None:
    """schedule=reference needs exactly one process."""
    if info.world_size != 1:
        raise ConfigError(
            f"schedule=reference runs in 1 process, but {info.world_size} were launched ({info.launcher}); "
            f"start it without torchrun/mpirun (or with --nproc_per_node=1 / -n 1)"
        )


def train(cfg: SysxConfig, info: DistInfo) -> int:
    """The ``sysx-train`` job for ``schedule=reference``: build, log, train, summarize. Returns 0."""
    check_single_process(info)
    cfg = resolve(cfg)
    trainer = ReferenceTrainer(cfg)
    run_dir = prepare_run_dir(cfg, is_main=True)
    data = f"data {cfg.data.name} ({len(trainer.dataset.split('train'))} train tokens, vocab {trainer.dataset.vocab_size})"
    print(describe_run(cfg, n_params=trainer.n_params, device=trainer.device, extra=data), flush=True)
    with RunLogger(
        run_dir,
        total_steps=cfg.train.steps,
        every=cfg.log.every,
        progress=cfg.log.progress,
        device=trainer.device,
    ) as logger:
        trainer.run(cfg.train.steps, logger=logger)
        logger.close()
    return 0
