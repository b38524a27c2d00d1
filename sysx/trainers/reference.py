"""``schedule=reference``: a plain single-process PyTorch training loop, the correctness reference.

Every other schedule is checked against it, so it does nothing clever: micro-batches, fp32 master
gradients, global norm, loss scaler, clipping, ``torch.optim.AdamW`` (two parameter groups:
matrices decayed, 1-D parameters not, :mod:`sysx.optim.decay`). Use it as a library:
``ReferenceTrainer(cfg).run(steps)`` returns one :class:`StepResult` per step;
:meth:`ReferenceTrainer.state_dict` gives the fp32 weights.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig

from sysx import device as dev
from sysx.checkpoint import Checkpoint, LayerState
from sysx.checkpoint.saver import LayerSource
from sysx.config import ConfigError, SysxConfig, resolve
from sysx.data.loss_weights import weighted_mean
from sysx.metrics import StepResult
from sysx.optim.decay import param_groups
from sysx.trainers.base import Trainer, job_device, open_dataset
from sysx.trainers.job import run_job

if TYPE_CHECKING:
    from sysx.data import TokenDataset
    from sysx.dist import DistInfo
    from sysx.model import LlamaModel

__all__ = ["ReferenceTrainer", "check_single_process", "open_dataset", "train"]


class ReferenceTrainer(Trainer):
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

        super().__init__(cfg, dataset=dataset, device=device)
        self.device = job_device(self.cfg, device)
        cfg = self.cfg

        fp32_model = model if model is not None else build_model(self.model_cfg, init=self.layer_init())
        fp32_model = fp32_model.to(self.device)
        self.masters: Sequence[torch.Tensor]  # fp32 weights the optimizer steps (the parameters themselves in fp32)
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
        self.optimizer = torch.optim.AdamW(  # matrices decayed, 1-D parameters not (optim.decay_norms)
            param_groups(self.masters, o.weight_decay, o.decay_norms),
            lr=o.lr,
            betas=(o.betas[0], o.betas[1]),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )

    # ------------------------------------------------------------------------------------ pieces
    @property
    def n_params(self) -> int:
        """Number of (distinct) parameters of the model."""
        return sum(p.numel() for p in self.params)

    def batch(
        self, step: int, micro_batch: int, *, split: str = "train", rows_per_step: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of one micro-batch, on the trainer's device (``rows_per_step``: the rows the
        micro-batches are cut from, by default a training step's)."""
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
            rows_per_step=rows_per_step or t.micro_batches * t.micro_batch_size,
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
        losses, weights = [], []
        share = self.loss_weights(step, n_mb, n_mb * self.cfg.train.micro_batch_size)
        for j in range(n_mb):
            x, y = self.batch(step, j)
            loss = self.model.loss(x, y)
            losses.append(loss.detach().float())
            weights.append(share.weight(y))
            scaled = loss / share.divisor(weights[-1])
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
        loss_value = (
            weighted_mean([float(v) for v in losses], weights) if share.per_token else float(torch.stack(losses).mean())
        )
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
        share = self.loss_weights(0, n, n * self.cfg.train.micro_batch_size, split="val")
        rows = n * self.cfg.train.micro_batch_size
        pieces = [self.batch(0, j, split="val", rows_per_step=rows) for j in range(n)]
        losses = [float(self.model.loss(x, y)) for x, y in pieces]
        return weighted_mean(losses, [share.weight(y) for _, y in pieces])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 weights (the masters for 16-bit runs), by parameter name, detached copies."""
        return {name: m.detach().clone() for name, m in zip(self._names, self.masters)}

    # ------------------------------------------------------------------------------ checkpoints
    def _by_layer(self) -> dict[int, list[tuple[str, torch.Tensor]]]:
        out: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, master in zip(self._names, self.masters):
            out.setdefault(int(name.split(".")[1]), []).append((name, master))
        return out

    def checkpoint_layers(self) -> dict[int, LayerSource]:
        """Every layer: fp32 masters and torch AdamW's moments and step (zeros before the first step)."""

        def source(index: int, params: list[tuple[str, torch.Tensor]]) -> LayerState:
            states = [self.optimizer.state.get(m, {}) for _, m in params]
            moments = [
                {n: s.get(k, torch.zeros_like(m)).detach().cpu() for (n, m), s in zip(params, states)}
                for k in ("exp_avg", "exp_avg_sq")
            ]
            steps = {int(s["step"]) if "step" in s else 0 for s in states}
            return LayerState(index, {n: m.detach().cpu() for n, m in params}, moments[0], moments[1], steps.pop())

        return {i: partial(source, i, params) for i, params in self._by_layer().items()}

    @torch.no_grad()
    def restore_layers(self, ckpt: Checkpoint) -> None:
        """Masters, the 16-bit copy, and torch AdamW's state of every layer from ``ckpt``."""
        for index, params in self._by_layer().items():
            saved = ckpt.layer(index)
            for name, master in params:
                master.copy_(saved.weight[name])
                self.optimizer.state[master] = {
                    "step": torch.tensor(float(saved.step)),
                    "exp_avg": saved.exp_avg[name].to(master.device).clone(),
                    "exp_avg_sq": saved.exp_avg_sq[name].to(master.device).clone(),
                }
        if self.masters is not self.params:
            for p, m in zip(self.params, self.masters):
                p.copy_(m)


def check_single_process(info: DistInfo, schedule: str = "reference") -> None:
    """``schedule`` (reference, single) needs exactly one process."""
    if info.world_size != 1:
        raise ConfigError(
            f"schedule={schedule} runs in 1 process, but {info.world_size} were launched ({info.launcher}); "
            f"start it without torchrun/mpirun (or with --nproc_per_node=1 / -n 1), or use schedule=sysx or auto"
        )


def train(cfg: SysxConfig, info: DistInfo) -> int:
    """The ``sysx-train`` job for ``schedule=reference``: build, log, train, summarize. Returns 0."""
    check_single_process(info)
    cfg = resolve(cfg)
    return run_job(ReferenceTrainer(cfg))
