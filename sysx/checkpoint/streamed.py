"""Layer files written and read in bounded chunks, for state that is not in host memory.

The NVMe tier keeps masters and Adam moments in state files; saving them through
:func:`sysx.checkpoint.layer_state.encode_layer` would need each layer's bytes in RAM. Here a layer
is a list of :class:`TensorStream` (name, dtype, shape, and a generator of the tensor's bytes in
pieces), written as the same safetensors layer file (header first, then each tensor's bytes in the
header's order), one piece at a time. :func:`layer_index` reads a layer file's header back, so a
restore can copy each tensor's bytes from where they lie in the file.

A file written here decodes to the same tensors as one :func:`encode_layer` writes; only the
header's key order may differ (safetensors writes its metadata map in hash order, so the bytes of
two host-memory saves differ there too).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class TensorStream:
    """One tensor of a layer file: ``key`` is ``<kind>/<param name>``; ``chunks()`` yields its bytes
    in order, in pieces that may be reused once the next piece is asked for."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterator[memoryview]]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize


@dataclass
class StreamedLayer:
    """A layer whose tensors are streamed (the counterpart of :class:`LayerState`)."""

    layer: int
    tensors: list[TensorStream]
    step: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors."""
        return sum(t.nbytes for t in self.tensors)


def memory_stream(key: str, tensor: torch.Tensor, chunk_bytes: int) -> TensorStream:
    """A host tensor as a stream (a tier keeps some kinds in RAM, e.g. the fp32 master)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu" or not flat.is_contiguous():
        raise ValueError(f"{key}: a streamed tensor must be a contiguous host tensor")

    def chunks() -> Iterator[memoryview]:
        data = flat.view(torch.uint8).numpy().data
        for start in range(0, len(data), chunk_bytes):
            yield data[start : start + chunk_bytes]

    return TensorStream(key, flat.dtype, tuple(tensor.shape), chunks)


def layer_header(layer: int, step: int, tensors: Sequence[TensorStream]) -> bytes:
    """The safetensors header (length prefix and JSON, space-padded to 8 bytes) of a layer file
    holding ``tensors`` in key order."""
    body: dict[str, object] = {"__metadata__": {"layer": str(layer), "step": str(step)}}
    offset = 0
    for t in sorted(tensors, key=lambda t: t.key):
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"{t.key}: dtype {t.dtype} cannot be streamed into a layer file")
        body[t.key] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(body, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def layer_chunks(state: StreamedLayer) -> Iterator[memoryview]:
    """The bytes of ``state``'s layer file, header first, one piece at a time; raises if a tensor's
    stream yields more or fewer bytes than its shape says."""
    yield memoryview(layer_header(state.layer, state.step, state.tensors))
    for t in sorted(state.tensors, key=lambda t: t.key):
        seen = 0
        for piece in t.chunks():
            seen += len(piece)
            if seen > t.nbytes:
                break
            yield piece
        if seen != t.nbytes:
            raise ValueError(
                f"layer {state.layer}: the stream of {t.key} gave {seen} bytes, its shape needs {t.nbytes}"
            )


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a layer file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def layer_index(path: str | os.PathLike[str]) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors (key -> :class:`TensorEntry`) and metadata of the layer file at ``path``, read
    from its header only."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {n} bytes; not a layer file")
        body = json.loads(f.read(n))
    metadata = body.pop("__metadata__", {}) or {}
    entries = {}
    for key, spec in body.items():
        begin, end = spec["data_offsets"]
        dtype = _TORCH_DTYPES.get(spec["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: {key} has dtype {spec['dtype']}, not one a layer file holds")
        entries[key] = TensorEntry(dtype, tuple(spec["shape"]), 8 + n + begin, end - begin)
    return entries, metadata
