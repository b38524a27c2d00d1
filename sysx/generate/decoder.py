"""Prefill the prompt in one pass, then one token per pass attending over the KV cache.

Each block's keys and values live in a :class:`~sysx.model.attention.KVCache` sized for the prompt
plus the new tokens; :meth:`Block.forward <sysx.model.layers.Block.forward>` with the cache at an
offset is the very code training runs its sequence chunks with, so a pass over ``T`` new positions
computes what the full-sequence forward computes at those positions. The cache and the layers share
one :class:`~sysx.single.rings.DeviceArena`: the device memory is allocated once, at its planned size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sysx import device as dev
from sysx.checkpoint.pretrained import PretrainedWeights
from sysx.generate.layers import HostLayers, ResidentLayers, StreamedLayers, load_host_layers, unit_shells
from sysx.generate.placement import Placement, kv_cache_bytes, plan_placement, work_bytes
from sysx.generate.sampling import Sampler
from sysx.memory.pinned import HostBuffers
from sysx.model.attention import KVCache
from sysx.model.layers import Block, Head
from sysx.single.rings import DeviceArena, align, typed


def plan(
    weights: PretrainedWeights, *, dtype: torch.dtype, prompt_len: int, positions: int, budget: int | None
) -> tuple[HostLayers, Placement]:
    """The units' shells and where they go, before any weight is read (a refusal costs nothing)."""
    host = unit_shells(weights, dtype)
    cfg = weights.config
    kv = kv_cache_bytes(cfg, positions, dtype)
    return host, plan_placement(host.unit_bytes(), kv, work_bytes(cfg, prompt_len, positions, dtype), budget)


class Decoder:
    """The model on ``device`` as ``placement`` says, with a KV cache of ``positions`` positions
    (one sequence). :meth:`forward` runs one pass of new tokens and returns the last one's logits."""

    def __init__(
        self,
        weights: PretrainedWeights,
        host: HostLayers,
        placement: Placement,
        *,
        device: torch.device,
        positions: int,
    ) -> None:
        cfg = weights.config
        self.cfg, self.device, self.positions, self.placement = cfg, device, positions, placement
        self.buffers = HostBuffers("sysx generate layers", pin=dev.is_cuda(device))
        load_host_layers(weights, host, self.buffers)
        self.host = host
        dtype = host.layouts[0].dtype
        units = {"kv": placement.kv_bytes}
        if placement.resident:
            units.update({f"unit {u}": b for u, b in enumerate(placement.unit_bytes)})
        else:
            units["ring"] = placement.window * align(placement.slot_bytes)
        self.arena = DeviceArena(device, units)
        kv = typed(self.arena.region("kv"), dtype).view(cfg.n_layers, 2, 1, cfg.n_kv_heads, positions, cfg.head_dim)
        self.caches = [KVCache(kv[i, 0], kv[i, 1]) for i in range(cfg.n_layers)]
        copy, self.compute = dev.new_stream(device), dev.current_stream(device)
        self.layers: ResidentLayers | StreamedLayers
        if placement.resident:
            regions = [self.arena.region(f"unit {u}") for u in range(len(placement.unit_bytes))]
            self.layers = ResidentLayers(host, regions, copy, self.compute)
        else:
            self.layers = StreamedLayers(host, self.arena.region("ring"), placement.window, copy, self.compute)

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], offset: int) -> torch.Tensor:
        """Logits ``[vocab]`` (fp32) after ``ids``, the tokens at positions ``offset ..`` of the sequence,
        whose earlier positions are in the cache."""
        if offset + len(ids) > self.positions:
            raise ValueError(f"positions {offset}..{offset + len(ids) - 1} exceed the KV cache's {self.positions}")
        assert self.host.embedding is not None  # loaded in __init__
        hidden = self.host.embedding(torch.tensor([list(ids)], dtype=torch.long)).to(self.device, non_blocking=True)
        for unit, cache in enumerate(self.caches):
            with self.layers.use(unit) as block:
                assert isinstance(block, Block)
                hidden = block(hidden, cache.at(offset))
        with self.layers.use(self.cfg.n_layers) as head:
            assert isinstance(head, Head)
            logits = head.logits(hidden[:, -1:])
        return logits[0, -1].float()


def generate(
    decoder: Decoder,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampler: Sampler,
    eos_ids: Sequence[int] = (),
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Up to ``max_new_tokens`` tokens after ``prompt``, ending early after an end-of-sequence id (kept,
    as ``transformers``' ``generate`` keeps it); ``on_token`` sees each as it is chosen."""
    logits = decoder.forward(prompt, 0)
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = sampler(logits)
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token in eos_ids or len(out) == max_new_tokens:
            break
        logits = decoder.forward([token], len(prompt) + len(out) - 1)
    return out
