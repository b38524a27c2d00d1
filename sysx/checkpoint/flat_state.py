"""Between flat optimizer buffers and layer-keyed checkpoint state.

Every host optimizer in sysx (a pipeline sub-stage, a sliding-window block group) holds one flat
fp32 master buffer, flat Adam moments and one step count for a few flat layers, laid out by a
:class:`sysx.model.FlatLayout` whose entry names are ``"<member>.<param>"``. ``layer_indices[member]``
is that member's flat layer index. These two functions cut such buffers into per-layer
:class:`LayerState` views (for saving) and fill them from per-layer tensors (for resuming, or for
pretrained weights), so checkpoints never depend on how layers were grouped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from sysx.checkpoint.layer_state import LayerState
from sysx.model.flat import FlatLayout


def entries_by_layer(
    layout: FlatLayout, layer_indices: Sequence[int]
) -> dict[int, list[tuple[str, slice, tuple[int, ...]]]]:
    out: dict[int, list[tuple[str, slice, tuple[int, ...]]]] = {}
    for e in layout.entries:
        member, _, rest = e.name.partition(".")
        index = layer_indices[int(member)]
        out.setdefault(index, []).append((f"layers.{index}.{rest}", slice(e.offset, e.offset + e.numel), e.shape))
    return out


def flat_layer_states(
    layout: FlatLayout,
    layer_indices: Sequence[int],
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: Callable[[], int],
) -> dict[int, Callable[[], LayerState]]:
    """Per-layer sources of views into the flat buffers (read when the save happens)."""
    sources: dict[int, Callable[[], LayerState]] = {}
    for index, entries in entries_by_layer(layout, layer_indices).items():

        def source(index: int = index, entries: list = entries) -> LayerState:
            views = [{name: t[sl].view(shape) for name, sl, shape in entries} for t in (master, exp_avg, exp_avg_sq)]
            return LayerState(index, views[0], views[1], views[2], step())

        sources[index] = source
    return sources


def load_flat(
    layout: FlatLayout,
    layer_indices: Sequence[int],
    tensors: Mapping[int, Mapping[str, torch.Tensor]],
    out: torch.Tensor,
    *,
    what: str,
) -> None:
    """Copy per-layer tensors (``layer -> name -> tensor``) into the flat buffer ``out`` (casting);
    every parameter of the layout must be there with its shape (``what`` names the source in errors)."""
    for index, entries in entries_by_layer(layout, layer_indices).items():
        layer = tensors[index]
        for name, sl, shape in entries:
            if name not in layer:
                raise ValueError(f"{what}: {name} is missing (found {sorted(layer)[:4]})")
            src = layer[name]
            if tuple(src.shape) != tuple(shape):
                raise ValueError(f"{what}: {name} has shape {tuple(src.shape)}, this model needs {tuple(shape)}")
            out[sl].view(shape).copy_(src)
