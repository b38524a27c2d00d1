"""Optional int8 compression of offloaded activations (PyAO §4.3 / §5.3: symmetric quantization).

A floating tensor is viewed as rows of its last dimension; each row gets one fp32 scale
``absmax / 127`` and its values are stored as ``round(x / scale)`` in int8. So a row of ``n``
values costs ``n + 4`` bytes instead of ``n * itemsize``, and the error of every value is at most
half a step: ``|x - dequantize(quantize(x))| <= scale / 2 = absmax(row) / 254``.

The packed form is one byte buffer ``[int8 payload | fp32 scales]`` so the executor can copy a
compressed activation as one contiguous block (to host and back) like any other saved tensor.
"""

from __future__ import annotations

import math

import torch

QMAX = 127.0
_SCALE_BYTES = 4  # one fp32 scale per row


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, row_length)`` of a tensor viewed as rows of its last dimension (a scalar is 1 x 1)."""
    if len(shape) == 0:
        return 1, 1
    cols = int(shape[-1])
    return (math.prod(shape) // cols if cols else 0), cols


def packed_nbytes(shape: tuple[int, ...]) -> int:
    """Bytes of the packed int8 form of a tensor of ``shape``: payload plus one fp32 scale per row."""
    rows, cols = rows_of(tuple(shape))
    payload = rows * cols
    pad = (-payload) % _SCALE_BYTES  # keep the fp32 scales 4-byte aligned
    return payload + pad + rows * _SCALE_BYTES


def quantize_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """Quantize floating ``x`` into the uint8 buffer ``out`` (``packed_nbytes(x.shape)`` bytes, same device)."""
    if not x.is_floating_point():
        raise TypeError(f"quantize_into: only floating tensors are compressed, got {x.dtype}")
    need = packed_nbytes(tuple(x.shape))
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != need:
        raise ValueError(
            f"quantize_into: out must be a 1-D uint8 buffer of {need} bytes, got {out.dtype} {tuple(out.shape)}"
        )
    rows, cols = rows_of(tuple(x.shape))
    payload = rows * cols
    pad = (-payload) % _SCALE_BYTES
    xf = x.detach().reshape(rows, cols).float()
    scale = xf.abs().amax(dim=1, keepdim=True) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(xf / safe), -QMAX, QMAX).to(torch.int8)
    out[:payload].view(torch.int8).view(rows, cols).copy_(q)
    out[payload + pad :].view(torch.float32).view(rows, 1).copy_(scale)


def dequantize(packed: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` that :func:`quantize_into` packed into ``packed`` (a new tensor)."""
    rows, cols = rows_of(tuple(shape))
    payload = rows * cols
    pad = (-payload) % _SCALE_BYTES
    q = packed[:payload].view(torch.int8).view(rows, cols)
    scale = packed[payload + pad : payload + pad + rows * _SCALE_BYTES].view(torch.float32).view(rows, 1)
    return (q.float() * scale).to(dtype).reshape(shape)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """The packed int8 form of ``x`` as a new uint8 buffer."""
    out = torch.empty(packed_nbytes(tuple(x.shape)), dtype=torch.uint8, device=x.device)
    quantize_into(x, out)
    return out


def compression_error(x: torch.Tensor) -> dict[str, float]:
    """Round-trip ``x`` through int8 and report the error and the bytes saved.

    Keys: ``max_abs`` (largest absolute error), ``max_rel_to_row_absmax`` (largest error divided by
    its row's absmax; the bound is 1/254), ``rel_l2`` (``||x - x'|| / ||x||``), ``bytes_raw``,
    ``bytes_packed`` and ``ratio`` (raw / packed).
    """
    rows, cols = rows_of(tuple(x.shape))
    back = dequantize(quantize(x), tuple(x.shape), x.dtype)
    err = (back.float() - x.float()).reshape(rows, cols)
    absmax = x.float().reshape(rows, cols).abs().amax(dim=1, keepdim=True)
    rel_row = torch.where(
        absmax > 0, err.abs() / absmax.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(err)
    )
    norm = float(x.float().norm())
    raw = x.numel() * x.element_size()
    packed = packed_nbytes(tuple(x.shape))
    return {
        "max_abs": float(err.abs().max()) if err.numel() else 0.0,
        "max_rel_to_row_absmax": float(rel_row.max()) if err.numel() else 0.0,
        "rel_l2": float(err.norm()) / norm if norm > 0 else 0.0,
        "bytes_raw": float(raw),
        "bytes_packed": float(packed),
        "ratio": raw / packed if packed else 1.0,
    }
