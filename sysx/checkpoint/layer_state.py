"""One flat layer's training state and its file format.

A layer file is a safetensors file whose tensors are named ``weight/<param>``, ``exp_avg/<param>``
and ``exp_avg_sq/<param>``, where ``<param>`` is the parameter's model-wide name
(``layers.5.attn.wq.weight``, the names of :meth:`sysx.trainers.reference.ReferenceTrainer.state_dict`),
and whose metadata holds the Adam step count. A tied output projection is stored once, with the
embedding (layer 0).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

KINDS = ("weight", "exp_avg", "exp_avg_sq")


@dataclass
class LayerState:
    """fp32 weights, Adam first and second moments (by parameter name) and the Adam step count."""

    layer: int
    weight: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors (what a snapshot of this layer costs in host memory)."""
        return sum(t.numel() * t.element_size() for kind in KINDS for t in getattr(self, kind).values())

    def snapshot(self) -> LayerState:
        """A copy that owns its memory: training may go on changing the original."""
        copy = {kind: {n: t.detach().clone(memory_format=torch.contiguous_format) for n, t in getattr(self, kind).items()}
                for kind in KINDS}
        return LayerState(self.layer, copy["weight"], copy["exp_avg"], copy["exp_avg_sq"], self.step)


def encode_layer(state: LayerState) -> bytes:
    """The safetensors bytes of a layer file."""
    tensors = {}
    for kind in KINDS:
        for name, tensor in getattr(state, kind).items():
            # safetensors refuses views that share one flat buffer; a contiguous copy per tensor is its format
            tensors[f"{kind}/{name}"] = tensor.detach().to("cpu").contiguous().clone()
    return st_save(tensors, metadata={"layer": str(state.layer), "step": str(state.step)})


def decode_layer(data: bytes, layer: int) -> LayerState:
    """Read a layer file's bytes back (tensors own their memory)."""
    header_len = struct.unpack("<Q", data[:8])[0]
    metadata = json.loads(data[8:8 + header_len]).get("__metadata__", {})
    parts: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in KINDS}
    for key, tensor in st_load(data).items():
        kind, _, name = key.partition("/")
        if kind not in parts:
            raise ValueError(f"layer file of layer {layer}: unexpected tensor {key!r}")
        parts[kind][name] = tensor
    if int(metadata.get("layer", layer)) != layer:
        raise ValueError(f"layer file of layer {layer} says it holds layer {metadata.get('layer')}")
    return LayerState(layer, parts["weight"], parts["exp_avg"], parts["exp_avg_sq"], int(metadata.get("step", 0)))
