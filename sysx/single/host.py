"""Host memory of the single-GPU executor: the training state of every group and its optimizer.

All training state lives in host memory (AdaWS appendix B): for every *group* — each Block, plus
one group for the Embedding and Head (one group so a tied weight is stepped once) — a
:class:`sysx.optim.StageOptimizer` (fp32 master flat buffer, CpuAdam, the 16-bit working copy the
device loads as its ``target``; the master itself in fp32) and the gradient buffer the device
sends gradients home into. Buffers the device copies to or from are page-locked at their exact
size when CUDA is present (:class:`sysx.memory.pinned.HostBuffers`).

The optimizer keeps no fp32 gradient buffer for 16-bit groups (``keep_grads=False``: converted
per job into buffers of a :class:`sysx.optim.scratch.ScratchPool` the groups share) and takes one fp32 norm per parameter (``param_spans``), so :meth:`HostState.grad_norm`
stacks them in the reference trainer's ``model.parameters()`` order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from sysx.memory.pinned import HostBuffers
from sysx.model.config import ModelConfig
from sysx.model.flat import FlatLayout
from sysx.model.llama import LayerInit, LlamaModel, make_layer, seed_init, tie_embeddings
from sysx.optim.decay import no_decay_ranges
from sysx.optim.nvme.tier import NvmeTier, TierStage
from sysx.optim.scratch import ScratchPool
from sysx.optim.stage import OptimSettings, StageOptimizer
from sysx.single.lanes import WORKERS
from sysx.single.plan_request import ModelSizes
from sysx.single.planner import GRAD_SCRATCH_BUFFERS


@dataclass
class HostGroup:
    """One group's host buffers and optimizer."""

    name: str
    layer_indices: tuple[int, ...]  # flat layer indices of the model (for state_dict names)
    layout: FlatLayout
    work: torch.Tensor  # compute dtype, what the device loads (the master for fp32)
    grad: torch.Tensor  # compute dtype, what the device writes home
    optimizer: StageOptimizer

    @property
    def master(self) -> torch.Tensor:
        """fp32 weights, what the optimizer updates."""
        return self.optimizer.master


def _init_layers(cfg: ModelConfig, init: LayerInit, model: LlamaModel | None) -> Callable[[int], nn.Module]:
    """A function giving flat layer ``i`` (fp32, filled by ``init``: one layer at a time)."""
    if model is not None:
        return lambda i: model.layers[i]

    def build(i: int) -> nn.Module:
        layer = make_layer(cfg, i, dtype=torch.float32, device="cpu")
        init(layer, i)
        return layer

    return build


def _static_layers(cfg: ModelConfig, init: LayerInit, model: LlamaModel | None) -> list[nn.Module]:
    if model is not None:
        return [model.layers[0], model.layers[-1]]
    emb = make_layer(cfg, 0, dtype=torch.float32, device="cpu")
    head = make_layer(cfg, cfg.n_layers + 1, dtype=torch.float32, device="cpu")
    if cfg.tie_embeddings:
        tie_embeddings(emb, head)
    init(emb, 0)
    init(head, cfg.n_layers + 1)
    return [emb, head]


class HostState:
    """Masters, working copies, gradient buffers and optimizers of every group (blocks, then static)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype,
        optim: OptimSettings,
        seed: int = 0,
        model: LlamaModel | None = None,
        pin: bool | None = None,
        init: LayerInit | None = None,
        job: str = "window",
    ) -> None:
        """``job``: names the NVMe tier's state directory (``optim.offload=nvme``)."""
        self.cfg = cfg
        self.dtype = dtype
        self.optim = optim
        self.buffers = HostBuffers("sliding-window training state", pin=pin)
        init = init or seed_init(seed)
        layer = _init_layers(cfg, init, model)
        self.groups: list[HostGroup] = []

        # Each group's layers are built (or read from pretrained weights) only when its turn comes and
        # dropped after, so the model is never held twice in host memory.
        def block(k: int) -> list[nn.Module]:
            return [layer(k + 1)]

        members: list[tuple[str, tuple[int, ...], Callable[[], list[nn.Module]]]] = [
            (f"block{k}", (k + 1,), partial(block, k)) for k in range(cfg.n_layers)
        ]
        members.append(("embedding+head", (0, cfg.n_layers + 1), lambda: _static_layers(cfg, init, model)))
        self.tier: NvmeTier | None = None
        self.scratch: ScratchPool | None = None
        try:
            if optim.offload == "nvme":
                self.tier = self._open_tier(cfg, optim, job, pin)
            if dtype != torch.float32:
                sizes = ModelSizes.of(cfg)
                largest = max(sizes.block_params, sizes.static_params)
                self.scratch = ScratchPool(
                    largest, GRAD_SCRATCH_BUFFERS, alloc=lambda n: self.buffers.empty(n, torch.float32)
                )
            for name, indices, build in members:
                self.groups.append(self._group(name, indices, build()))
        except BaseException:
            self.close()
            raise

    def _group(self, name: str, indices: tuple[int, ...], modules: list[nn.Module]) -> HostGroup:
        """One group's buffers and optimizer, from its fp32 layers (dropped by the caller after)."""
        fp32 = self.dtype == torch.float32
        layout = FlatLayout.from_modules(modules)
        flat = layout.flatten(modules).float()
        master = (self.buffers.empty(layout.numel, torch.float32) if fp32 else torch.empty(layout.numel)).copy_(flat)
        work = master if fp32 else self.buffers.empty(layout.numel, self.dtype).copy_(flat)
        grad = self.buffers.empty(layout.numel, self.dtype).zero_()
        spans = [(e.offset, e.numel) for e in layout.entries]
        stage = StageOptimizer.from_settings(
            name,
            master,
            self.optim,
            target=None if fp32 else work,
            grad_buffer=grad if fp32 else None,
            keep_grads=fp32,
            param_spans=spans,
            no_decay=no_decay_ranges(e.shape for e in layout.entries),
            scratch=self.scratch,
            store=self.tier.state(name) if self.tier is not None else None,
        )
        return HostGroup(name, indices, layout, work, grad, stage)

    def _open_tier(self, cfg: ModelConfig, optim: OptimSettings, job: str, pin: bool | None) -> NvmeTier:
        """The groups' states in ``optim.nvme_dir``: registered in the order a step takes them (the
        blocks backwards, then Embedding+Head), which the first step's read-ahead follows."""
        from sysx.optim.nvme.open_tier import open_tier

        sizes = ModelSizes.of(cfg)
        in_ram = self.dtype == torch.float32  # the fp32 master is the working copy the device loads
        stages = [
            TierStage.of(f"block{k}", sizes.block_params, param_in_ram=in_ram, rollback=optim.rollback)
            for k in reversed(range(cfg.n_layers))
        ]
        stages.append(TierStage.of("embedding+head", sizes.static_params, param_in_ram=in_ram, rollback=optim.rollback))
        return open_tier(optim, stages, job=job, node=0, rank=0, workers=WORKERS, pin=pin)

    @property
    def static(self) -> HostGroup:
        """The Embedding+Head group (the last one)."""
        return self.groups[-1]

    @property
    def stages(self) -> list[StageOptimizer]:
        """Every group's optimizer, blocks first."""
        return [g.optimizer for g in self.groups]

    @property
    def n_params(self) -> int:
        """Distinct parameters of the model."""
        return sum(g.layout.numel for g in self.groups)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 weights by the reference trainer's names (``layers.<flat index>.<param>``), copies."""
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            master = g.optimizer.master_copy()
            for e in g.layout.entries:
                member, _, rest = e.name.partition(".")
                flat_index = g.layer_indices[int(member)]
                out[f"layers.{flat_index}.{rest}"] = master[e.offset : e.offset + e.numel].view(e.shape).clone()
        return out

    def grad_norm(self) -> float:
        """Global L2 norm of the loaded gradients: per-parameter fp32 norms stacked in
        ``model.parameters()`` order (Embedding, Blocks, Head), as the reference trainer takes it."""
        static = self.static
        first = [n for n, e in zip(static.optimizer.param_norms, static.layout.entries) if e.name.startswith("0.")]
        last = [n for n, e in zip(static.optimizer.param_norms, static.layout.entries) if not e.name.startswith("0.")]
        blocks = [n for g in self.groups[:-1] for n in g.optimizer.param_norms]
        return float(torch.linalg.vector_norm(torch.stack(first + blocks + last)))

    def close(self) -> None:
        """Release the optimizers and free the (page-locked) buffers."""
        for stage in self.stages:
            stage.close()
        self.groups.clear()
        try:
            if self.tier is not None:
                self.tier.close()  # removes the state files
        finally:
            self.buffers.close()
