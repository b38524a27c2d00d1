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
from safetensors import TensorSpec, serialize
from safetensors.torch import load as st_load

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

    def snapshot(self, into: LayerState | None = None) -> LayerState:
        """A copy that owns its memory (training may go on changing the original), written into
        ``into``'s tensors when their shapes match: a saver reuses its buffers, so only its first
        save pays for fresh pages."""
        copy: dict[str, dict[str, torch.Tensor]] = {}
        for kind in KINDS:
            old = getattr(into, kind) if into is not None else {}
            copy[kind] = {}
            for n, t in getattr(self, kind).items():
                buf = old.get(n)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = torch.empty(t.shape, dtype=t.dtype)
                copy[kind][n] = buf.copy_(t.detach())
        return LayerState(self.layer, copy["weight"], copy["exp_avg"], copy["exp_avg_sq"], self.step)


def encode_layer(state: LayerState) -> bytes:
    """The safetensors bytes of a layer file, serialized straight from the tensors' memory.

    The tensors are usually views of one flat optimizer buffer, which ``safetensors.torch.save``
    refuses (shared storage) and would copy; :func:`safetensors.serialize` takes each view's
    address instead, so the only copy is into the file's bytes."""
    tensors = {f"{kind}/{name}": t.detach().contiguous() for kind in KINDS for name, t in getattr(state, kind).items()}
    specs = {
        name: TensorSpec(
            dtype=str(t.dtype).split(".")[-1],
            shape=list(t.shape),
            data_ptr=t.data_ptr(),
            data_len=t.numel() * t.element_size(),
        )
        for name, t in tensors.items()
    }
    if any(t.device.type != "cpu" for t in tensors.values()):
        raise ValueError(f"layer {state.layer}: checkpoint tensors must be host tensors")
    return serialize(specs, metadata={"layer": str(state.layer), "step": str(state.step)})  # `tensors` keeps them alive


def decode_layer(data: bytes, layer: int) -> LayerState:
    """Read a layer file's bytes back (tensors own their memory)."""
    header_len = struct.unpack("<Q", data[:8])[0]
    metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
    parts: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in KINDS}
    for key, tensor in st_load(data).items():
        kind, _, name = key.partition("/")
        if kind not in parts:
            raise ValueError(f"layer file of layer {layer}: unexpected tensor {key!r}")
        parts[kind][name] = tensor
    if int(metadata.get("layer", layer)) != layer:
        raise ValueError(f"layer file of layer {layer} says it holds layer {metadata.get('layer')}")
    return LayerState(layer, parts["weight"], parts["exp_avg"], parts["exp_avg_sq"], int(metadata.get("step", 0)))
