"""The model's layers for sampling: flat copies in (pinned) host memory, and the two ways the device
gets them: :class:`ResidentLayers` (copied once into an arena region each) and :class:`StreamedLayers`
(a :class:`~sysx.single.rings.Ring` of device slots, the next layers prefetched on the copy stream
while the current one computes).

Units are the device's layers in pass order: the blocks, then the head. Compute modules are storage-
less shells (:func:`~sysx.model.llama.make_shell`) bound to the device bytes that hold the unit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from sysx import device as dev
from sysx.checkpoint.pretrained import PretrainedWeights, pretrained_init
from sysx.memory.pinned import HostBuffers
from sysx.model.flat import FlatLayout
from sysx.model.layers import Embedding
from sysx.model.llama import make_layer, make_shell
from sysx.single.rings import Ring, typed


@dataclass
class HostLayers:
    """The embedding (a CPU module: a prompt's rows are looked up on the host) and, per unit, its
    shell, its flat layout and its flat values in host memory (empty until :func:`load_host_layers`)."""

    embedding: Embedding | None
    shells: list[nn.Module]
    layouts: list[FlatLayout]
    flats: list[torch.Tensor]

    def unit_bytes(self) -> list[int]:
        """Bytes of each unit's flat buffer."""
        return [layout.numel * layout.dtype.itemsize for layout in self.layouts]


def unit_shells(weights: PretrainedWeights, dtype: torch.dtype) -> HostLayers:
    """The shells and layouts of the units (no values, no memory): enough to plan the placement."""
    cfg = weights.config
    shells = [make_shell(cfg, index, dtype=dtype) for index in range(1, cfg.n_layers + 2)]
    return HostLayers(None, shells, [FlatLayout.from_modules([shell]) for shell in shells], [])


def _untied(weights: PretrainedWeights) -> PretrainedWeights:
    """``weights`` whose head, in a tied model, carries the embedding as its own projection: a unit's
    buffer must hold all the unit computes with."""
    cfg = weights.config

    def layer(index: int) -> dict[str, torch.Tensor]:
        tensors = dict(weights.layer(index))
        if cfg.tie_embeddings and index == cfg.n_layers + 1:
            tensors[f"layers.{index}.lm_head.weight"] = weights.layer(0)["layers.0.weight"]
        return tensors

    return PretrainedWeights(weights.source, cfg, layer)


def load_host_layers(weights: PretrainedWeights, host: HostLayers, buffers: HostBuffers) -> None:
    """Read the weights layer by layer into ``host``: the embedding module and each unit's flat values."""
    dtype = host.layouts[0].dtype
    embedding = make_layer(weights.config, 0, dtype=dtype)
    pretrained_init(weights)(embedding, 0)
    assert isinstance(embedding, Embedding)  # flat layer 0
    host.embedding = embedding.requires_grad_(False)
    init = pretrained_init(_untied(weights))
    for index, layout in enumerate(host.layouts, start=1):
        layer = make_layer(weights.config, index, dtype=dtype)  # untied, as the shells are
        init(layer, index)
        flat = buffers.empty(layout.numel, dtype)
        flat.copy_(layout.flatten([layer]))
        host.flats.append(flat)


class ResidentLayers:
    """Every unit copied once into its own device region; :meth:`use` only hands out the module."""

    def __init__(self, host: HostLayers, regions: list[torch.Tensor], copy: dev.Stream, compute: dev.Stream) -> None:
        self.host = host
        with copy.use():
            for shell, layout, flat, region in zip(host.shells, host.layouts, host.flats, regions):
                on_device = typed(region, layout.dtype, layout.numel)
                on_device.copy_(flat, non_blocking=True)
                layout.bind([shell], on_device)
        compute.wait_event(copy.record_event())

    @contextlib.contextmanager
    def use(self, unit: int) -> Iterator[nn.Module]:
        """Unit ``unit``'s module, on the device."""
        yield self.host.shells[unit]


class StreamedLayers:
    """The units cycle through a ring of ``window`` slots in pass order: unit after unit, pass after
    pass. The slot a unit used is refilled with the unit ``window`` places later as soon as the unit
    is done, so ``window - 1`` units are in flight on the copy stream while one computes."""

    def __init__(
        self, host: HostLayers, region: torch.Tensor, window: int, copy: dev.Stream, compute: dev.Stream
    ) -> None:
        self.host = host
        self.ring = Ring("generate layers", region, window, max(host.unit_bytes()))
        self.copy, self.compute = copy, compute
        self.filled = 0  # units issued to the ring, counted over all passes
        self.used = 0  # units computed
        for _ in range(window):
            self._fill()

    def _fill(self) -> None:
        seq = self.filled
        unit = seq % len(self.host.shells)
        layout, flat = self.host.layouts[unit], self.host.flats[unit]
        self.ring.fill(
            self.ring.slot_of(seq),
            seq,
            self.copy,
            lambda raw: typed(raw, layout.dtype, layout.numel).copy_(flat, non_blocking=True),
        )
        self.filled += 1

    @contextlib.contextmanager
    def use(self, unit: int) -> Iterator[nn.Module]:
        """Unit ``unit``'s module bound to its slot; it must be the next unit in pass order."""
        seq = self.used
        if seq % len(self.host.shells) != unit:
            raise RuntimeError(
                f"StreamedLayers: unit {unit} asked for, the pass order says {seq % len(self.host.shells)}"
            )
        slot = self.ring.slot_of(seq)
        raw = self.ring.acquire(slot, seq, self.compute)
        layout, shell = self.host.layouts[unit], self.host.shells[unit]
        layout.bind([shell], typed(raw, layout.dtype, layout.numel))
        yield shell
        self.ring.release(slot, self.compute)
        self.used += 1
        self._fill()
