"""Host memory of the single-GPU executor: the training state, per-layer CPU Adam, and its thread.

All training state lives in host memory (AdaWS appendix B): for every *group* — each Block, plus
one group for the Embedding and Head (one group so a tied weight is stepped once) — an fp32 master
flat buffer with its :class:`sysx.optim.CpuAdam`, the 16-bit working copy the device loads (the
master itself in fp32), and the gradient buffer the device sends gradients home into. Buffers the
device copies to or from are pinned when CUDA is present.

:class:`OptimizerWorker` runs per-group work on a background thread, so a group's Adam step
overlaps the GPU's work on other layers (the GPU-CPU pipeline); ``wait(group)`` blocks until the
last task submitted for a group is done (before its weights are loaded again).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from sysx import device as dev
from sysx.model.config import ModelConfig
from sysx.model.flat import FlatLayout


class LayerOptimizer(Protocol):
    """What the executor needs from a group's optimizer (``sysx.optim.CpuAdam`` provides it)."""

    def step(self, grad: torch.Tensor, *, lr: float | None = None) -> None: ...

    def undo(self, grad: torch.Tensor | None = None) -> None: ...


@dataclass(frozen=True)
class AdamHyper:
    """AdamW hyper-parameters and the CpuAdam backend."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    backend: str = "auto"


@dataclass
class HostGroup:
    """One group's host buffers and optimizer."""

    name: str
    layer_indices: tuple[int, ...]  # flat layer indices of the model (for state_dict names)
    layout: FlatLayout
    master: torch.Tensor  # fp32, what the optimizer updates
    work: torch.Tensor  # compute dtype, what the device loads (``master`` for fp32)
    grad: torch.Tensor  # grad dtype, what the device writes home
    opt: LayerOptimizer

    def grad_fp32(self, scale: float) -> torch.Tensor:
        """fp32 unscaled gradients: ``grad`` itself for fp32 (scale 1), else a new converted tensor."""
        if self.grad.dtype == torch.float32 and scale == 1.0:
            return self.grad
        g = self.grad.float()
        if scale != 1.0:
            g.div_(scale)
        return g

    def publish(self) -> None:
        """Copy the updated fp32 masters into the working copy the device loads (no-op for fp32)."""
        if self.work.data_ptr() != self.master.data_ptr():
            self.work.copy_(self.master)


def _pinned_like(src: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    out = dev.empty_host(src.numel(), dtype, pin=pin)
    out.copy_(src)
    return out


def _init_layers(cfg: ModelConfig, seed: int, model: nn.Module | None) -> Callable[[int], nn.Module]:
    """A function giving flat layer ``i`` (fp32, initialised like ``build_model(cfg, seed=seed)``)."""
    from sysx.model.llama import init_layer, make_layer

    if model is not None:
        return lambda i: model.layers[i]  # type: ignore[index]

    def build(i: int) -> nn.Module:
        layer = make_layer(cfg, i, dtype=torch.float32, device="cpu")
        init_layer(layer, i, seed=seed)
        return layer

    return build


def _static_layers(cfg: ModelConfig, seed: int, model: nn.Module | None) -> list[nn.Module]:
    from sysx.model.llama import init_layer, make_layer, tie_embeddings

    if model is not None:
        return [model.layers[0], model.layers[-1]]  # type: ignore[index]
    emb = make_layer(cfg, 0, dtype=torch.float32, device="cpu")
    head = make_layer(cfg, cfg.n_layers + 1, dtype=torch.float32, device="cpu")
    if cfg.tie_embeddings:
        tie_embeddings(emb, head)
    init_layer(emb, 0, seed=seed)
    init_layer(head, cfg.n_layers + 1, seed=seed)
    return [emb, head]


class HostState:
    """Masters, working copies, gradient buffers and optimizers of every group (blocks, then static)."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, hyper: AdamHyper, seed: int = 0,
                 model: nn.Module | None = None, pin: bool | None = None, rollback: str = "undo") -> None:
        from sysx.optim.cpu_adam import CpuAdam

        self.cfg = cfg
        self.dtype = dtype
        pin = dev.cuda_available() if pin is None else pin
        layer = _init_layers(cfg, seed, model)
        self.groups: list[HostGroup] = []
        members: list[tuple[str, tuple[int, ...], list[nn.Module]]] = [
            (f"block{k}", (k + 1,), [layer(k + 1)]) for k in range(cfg.n_layers)
        ]
        members.append(("embedding+head", (0, cfg.n_layers + 1), _static_layers(cfg, seed, model)))
        for name, indices, modules in members:
            layout = FlatLayout.from_modules(modules)
            flat = layout.flatten(modules).float()
            master = _pinned_like(flat, torch.float32, pin and dtype == torch.float32)
            work = master if dtype == torch.float32 else _pinned_like(flat, dtype, pin)
            grad = dev.empty_host(layout.numel, dtype, pin=pin).zero_()
            opt = CpuAdam(master, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay,
                          backend=hyper.backend, rollback=rollback)
            self.groups.append(HostGroup(name, indices, layout, master, work, grad, opt))
            del flat

    @property
    def static(self) -> HostGroup:
        """The Embedding+Head group (the last one)."""
        return self.groups[-1]

    @property
    def n_params(self) -> int:
        """Distinct parameters of the model."""
        return sum(g.layout.numel for g in self.groups)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 weights by the reference trainer's names (``layers.<flat index>.<param>``), copies."""
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            for e in g.layout.entries:
                member, _, rest = e.name.partition(".")
                flat_index = g.layer_indices[int(member)]
                out[f"layers.{flat_index}.{rest}"] = g.master[e.offset:e.offset + e.numel].view(e.shape).clone()
        return out

    def host_bytes(self) -> int:
        """Bytes of the host buffers (masters, moments, working copies, gradients)."""
        total = 0
        for g in self.groups:
            n = g.layout.numel
            total += 12 * n + g.grad.element_size() * n
            if g.work.data_ptr() != g.master.data_ptr():
                total += g.work.element_size() * n
        return total


class OptimizerWorker:
    """One background thread running per-group tasks in submission order (the trainer uses one for
    gradient norms and one for Adam steps, so waiting for the norms never waits for the steps)."""

    def __init__(self, name: str = "adam") -> None:
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sysx-single-{name}")
        self._last: dict[int, cf.Future] = {}
        self._lock = threading.Lock()

    def submit(self, group: int, task: Callable[[], object]) -> cf.Future:
        """Queue ``task`` for ``group``; :meth:`wait` on the group waits for it."""
        fut = self._pool.submit(task)
        with self._lock:
            self._last[group] = fut
        return fut

    def wait(self, group: int) -> None:
        """Block until the last task of ``group`` is done (re-raises its exception)."""
        with self._lock:
            fut = self._last.get(group)
        if fut is not None:
            fut.result()

    def wait_all(self, groups: Sequence[int] | None = None) -> None:
        """Wait for every group's last task (or those of ``groups``)."""
        with self._lock:
            items = list(self._last.items())
        for group, fut in items:
            if groups is None or group in groups:
                fut.result()

    def close(self) -> None:
        """Finish queued work and stop the thread."""
        self._pool.shutdown(wait=True)
