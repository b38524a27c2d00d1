"""The Llama model as a flat list of layers, its deterministic initialisation, and slice execution.

Layer ``i`` of the flat list: ``0`` is the Embedding, ``1..n_layers`` the Blocks, ``n_layers + 1``
the Head. A runtime may build only the layers of its stages (:func:`build_layers`); they get the
same initial values as the same layers of :func:`build_model`, because every layer draws from
its own generator seeded by ``(seed, layer index)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import nn

from sysx.model.config import ModelConfig
from sysx.model.layers import Block, Embedding, Head, RMSNorm

INIT_STD = 0.02  # HF LlamaConfig.initializer_range

# How a freshly made flat layer gets its values: ``init(layer, index)`` fills it in place. The default
# is :func:`init_layer` with the job's seed; pretrained weights come through the same door
# (:func:`sysx.checkpoint.pretrained.pretrained_init`), so every builder streams them layer by layer.
LayerInit = Callable[[nn.Module, int], None]


def seed_init(seed: int) -> LayerInit:
    """The deterministic random initialisation of :func:`init_layer` with ``seed``."""
    return lambda layer, index: init_layer(layer, index, seed=seed)


def make_layer(
    cfg: ModelConfig, index: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> nn.Module:
    """Uninitialised layer ``index`` of the flat list (0: Embedding, 1..L: Block, L+1: Head)."""
    n_total = cfg.n_layers + 2
    if not 0 <= index < n_total:
        raise IndexError(f"layer index {index} out of range: the model has {n_total} flat layers (0..{n_total - 1})")
    if index == 0:
        return Embedding(cfg, device=device, dtype=dtype)
    if index == n_total - 1:
        return Head(cfg, device=device, dtype=dtype)
    return Block(cfg, device=device, dtype=dtype)


def make_shell(cfg: ModelConfig, index: int, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Layer ``index`` with parameters of the right shapes but no storage behind them: each is a
    one-element CPU tensor broadcast to its shape, to be bound to a buffer on the device
    (:meth:`~sysx.model.flat.FlatLayout.bind`) before use. Building compute modules this way
    allocates nothing on the device and (almost) nothing on the host."""
    layer = make_layer(cfg, index, dtype=dtype, device="meta")
    _stand_ins(layer, {})
    return layer


def _stand_ins(module: nn.Module, made: dict[int, nn.Parameter]) -> None:
    """Swap every meta Parameter of ``module`` for a storage-less CPU stand-in (one per Parameter, so ties stay ties)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                empty = torch.empty(1, dtype=p.dtype).expand(p.shape)
                made[id(p)] = nn.Parameter(empty, requires_grad=p.requires_grad)
            sub._parameters[name] = made[id(p)]


def tie_embeddings(embedding: nn.Module, head: nn.Module) -> None:
    """Make ``head.lm_head.weight`` the very Parameter of ``embedding.weight`` (tied embeddings);
    ``embedding`` and ``head`` are flat layers 0 and ``n_layers + 1`` (:func:`make_layer`)."""
    if not isinstance(embedding, Embedding) or not isinstance(head, Head):
        raise TypeError(f"cannot tie {type(embedding).__name__} to {type(head).__name__}: need an Embedding and a Head")
    head.lm_head.weight = embedding.weight
    embedding.tied_to_head = True
    head.tied_to_embedding = True


def _layer_generator(seed: int, index: int) -> torch.Generator:
    if not 0 <= index < (1 << 20):
        raise ValueError(f"layer index {index} must be in [0, 2**20)")
    return torch.Generator(device="cpu").manual_seed(seed * (1 << 20) + index)


@torch.no_grad()
def init_layer(layer: nn.Module, index: int, *, seed: int = 0) -> None:
    """Initialise one flat layer in place like HF: weights ~ N(0, 0.02), RMSNorm weights = 1.

    Values are drawn on the CPU in fp32 from a generator seeded by ``(seed, index)`` and then
    copied, so they do not depend on the global RNG, the device or (beyond rounding) the dtype.
    A Head tied to the Embedding leaves the shared weight to the Embedding.
    """
    gen = _layer_generator(seed, index)
    norm_weights = {id(m.weight) for m in layer.modules() if isinstance(m, RMSNorm)}
    for name, param in layer.named_parameters():
        if isinstance(layer, Head) and layer.tied_to_embedding and name == "lm_head.weight":
            continue
        if id(param) in norm_weights:
            param.fill_(1.0)
        else:
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)
            param.copy_(values)


class LlamaModel(nn.Module):
    """Llama-2/3 decoder: ``layers = [Embedding, Block x n_layers, Head]``.

    ``forward(input_ids)`` returns logits; ``loss(input_ids, labels)`` the mean token loss.
    The constructor leaves parameters uninitialised; use :func:`build_model`.
    """

    def __init__(
        self, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList([make_layer(cfg, i, dtype=dtype, device=device) for i in range(cfg.n_layers + 2)])
        if cfg.tie_embeddings:
            tie_embeddings(self.layers[0], self.layers[-1])

    @property
    def embedding(self) -> Embedding:
        """The first flat layer."""
        return cast(Embedding, self.layers[0])  # __init__ puts the Embedding first

    @property
    def head(self) -> Head:
        """The last flat layer."""
        return cast(Head, self.layers[-1])  # and the Head last

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, T] -> logits [B, T, vocab]``."""
        return run_layers(self.layers, input_ids)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``labels`` (target of each position, -100 = ignored)."""
        return run_layers(self.layers, input_ids, labels)


def build_model(
    cfg: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    init: LayerInit | None = None,
) -> LlamaModel:
    """A deterministically initialised :class:`LlamaModel` (independent of the global RNG), or one
    filled by ``init``."""
    model = LlamaModel(cfg, dtype=dtype, device=device)
    init = init or seed_init(seed)
    for index, layer in enumerate(model.layers):
        init(layer, index)
    return model


def build_layers(
    cfg: ModelConfig,
    start: int,
    stop: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    init: LayerInit | None = None,
) -> list[nn.Module]:
    """Flat layers ``start..stop-1``, equal to ``build_model(cfg, ...).layers[start:stop]``.

    With tied embeddings the slice must hold both the Embedding and the Head or neither.
    """
    n_total = cfg.n_layers + 2
    if not 0 <= start < stop <= n_total:
        raise ValueError(f"bad layer slice [{start}, {stop}): the model has {n_total} flat layers")
    if cfg.tie_embeddings and (start == 0) != (stop == n_total):
        raise ValueError(
            f"layer slice [{start}, {stop}) holds only one side of the tied embedding "
            f"(Embedding = layer 0, Head = layer {n_total - 1} share one weight); splitting a tie "
            f"across stages is not supported: use tie_embeddings=False or keep both in one slice"
        )
    layers = [make_layer(cfg, i, dtype=dtype, device=device) for i in range(start, stop)]
    if cfg.tie_embeddings and start == 0:
        tie_embeddings(layers[0], layers[-1])
    init = init or seed_init(seed)
    for offset, layer in enumerate(layers):
        init(layer, start + offset)
    return layers


def run_layers(layers: Iterable[nn.Module], x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """Run a contiguous slice of flat layers on ``x`` (token ids before the Embedding, else hidden).

    The Head gets ``labels`` and returns the loss (or the logits when ``labels`` is None); a
    slice without the Head returns hidden states and ignores ``labels``.
    """
    for layer in layers:
        x = layer(x, labels) if isinstance(layer, Head) else layer(x)
    return x
