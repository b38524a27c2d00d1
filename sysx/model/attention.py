"""Attention pieces shared by the plain and the sequence-chunked paths of :class:`sysx.model.layers.Attention`.

RoPE tables (:func:`rope_cos_sin`), causal SDPA over grouped K/V heads (:func:`attend`), and the
sequence chunks of a sequence too long for one pass: :class:`KVCache`, :func:`extend_cache` and
:func:`chunk_attention`, which compute what the unchunked attention computes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from sysx.model.config import ModelConfig

# torch >= 2.5: scaled_dot_product_attention takes fewer K/V heads than query heads (enable_gqa)
SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


# ------------------------------------------------------------------------------------------ RoPE


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` in fp32, as HF's ``default`` or ``llama3`` RoPE init computes them."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if cfg.rope_type != "llama3":
        return inv_freq
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_len
    assert factor is not None and low is not None and high is not None and old_len is not None  # ModelConfig checked
    # Llama-3.1: wavelengths shorter than old_len / high stay, longer than old_len / low are stretched by
    # `factor`, and those between are interpolated (HF _compute_llama3_parameters, same operation order)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@functools.lru_cache(maxsize=64)
def rope_cos_sin(
    cfg: ModelConfig, seq_len: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``(cos, sin)`` of shape ``[seq_len, head_dim]`` for positions ``0..seq_len-1``.

    Computed like HF ``LlamaRotaryEmbedding`` (inverse frequencies in fp32 on the CPU, angles in
    fp32 on ``device``, halves concatenated, then cast to ``dtype``) and cached per shape/device. A
    position's row does not depend on ``seq_len``, so a chunk slices the table of its whole sequence.
    """
    with torch.inference_mode(False), torch.no_grad():
        inv_freq = rope_inv_freq(cfg).to(device)
        positions = torch.arange(seq_len, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (the HF / GPT-NeoX RoPE layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[B, H, T, head_dim]`` by the tables ``cos``/``sin`` ``[T, head_dim]``."""
    return x * cos + rotate_half(x) * sin


# ------------------------------------------------------------------------------------ attention


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Causal SDPA of ``q [B, H, Tq, D]`` over ``k, v [B, Hkv, Tk, D]``, the queries being the last ``Tq``
    of the ``Tk`` positions; returns ``[B, H, Tq, Dv]``."""
    bsz, n_heads, tq, head_dim = q.shape
    n_kv, tk = k.shape[1], k.shape[2]
    n_rep = n_heads // n_kv
    gqa: dict[str, Any] = {}  # keyword arguments: older torch has no enable_gqa
    if n_rep > 1 and SDPA_GQA:
        # Each KV head serves n_rep consecutive query heads (HF ``repeat_kv``); the flash kernels
        # read the shared K/V directly instead of n_rep materialised copies.
        gqa = {"enable_gqa": True}
    elif n_rep > 1:
        k = k[:, :, None].expand(bsz, n_kv, n_rep, tk, head_dim).reshape(bsz, n_heads, tk, head_dim)
        v = v[:, :, None].expand(bsz, n_kv, n_rep, tk, v.shape[-1]).reshape(bsz, n_heads, tk, v.shape[-1])
    if tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **gqa)
    # lower-right causal: flash attention aligns it natively on CUDA; elsewhere the mask is materialised.
    # Imported here: torch.nn.attention.bias imports torch._dynamo, which the pre-flight of every
    # launch script (sysx-train --check) would pay (0.8 s of its 3.5 s) while only sequence chunks
    # and generation reach this line.
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(tq, tk), scale=scale, **gqa)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D] -> [B, T, H * D]``."""
    bsz, n_heads, seq_len, head_dim = y.shape
    return y.transpose(1, 2).reshape(bsz, seq_len, n_heads * head_dim)


@torch.library.custom_op("sysx::chunk_attention", mutates_args=())
def chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`attend` of a chunk's queries over the keys/values of its prefix and itself, heads merged:
    ``[B, H, Tq, D] x [B, Hkv, Tk, D] -> [B, Tq, H * Dv]`` (one op, whatever ``Tk``)."""
    return merge_heads(attend(query, key, value, scale=scale)).contiguous()


@chunk_attention.register_fake
def _chunk_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    bsz, n_heads, seq_len, _ = query.shape
    return query.new_empty((bsz, seq_len, n_heads * value.shape[-1]))


def _chunk_attention_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    query, key, value, scale = inputs
    ctx.save_for_backward(query, key, value)
    ctx.scale = scale  # type: ignore[attr-defined]


def _chunk_attention_backward(
    ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    saved = ctx.saved_tensors  # type: ignore[attr-defined]
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in saved]
        out = merge_heads(attend(*leaves, scale=ctx.scale))  # type: ignore[attr-defined]
        dq, dk, dv = torch.autograd.grad(out, leaves, grad)
    return dq, dk, dv, None


chunk_attention.register_autograd(_chunk_attention_backward, setup_context=_chunk_attention_setup)


# -------------------------------------------------------------------------------- the K/V cache


@dataclass(frozen=True)
class KVCache:
    """Rotated keys and values ``[B, Hkv, S, D]`` of the sequences a block is processing in chunks, and
    where the current chunk starts. ``grad_key``/``grad_value`` (fp32, same shape) collect, during the
    backward over chunks in reverse order, the gradient later chunks send to earlier positions; they
    must be zero before the last chunk's backward. A batch of fewer rows uses the first rows."""

    key: torch.Tensor
    value: torch.Tensor
    offset: int = 0
    grad_key: torch.Tensor | None = None
    grad_value: torch.Tensor | None = None

    @property
    def seq_len(self) -> int:
        """Positions of the whole sequence (the RoPE table the chunks slice)."""
        return self.key.shape[2]

    def at(self, offset: int) -> KVCache:
        """The same cache for the chunk starting at ``offset``."""
        return replace(self, offset=offset)

    def span(self, t: torch.Tensor, rows: int, start: int, length: int) -> torch.Tensor:
        """``t[:rows, :, start:start + length]``, by ``narrow``: the same ops whatever the bounds (plain
        indexing dispatches ``alias`` instead of ``slice`` for a whole dimension, and a replay of the
        chunk's forward must dispatch what its profile did)."""
        return t.narrow(0, 0, rows).narrow(2, start, length)

    def write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store a chunk's rotated ``key``/``value`` ``[b, Hkv, T, D]`` at the current offset."""
        rows, length = key.shape[0], key.shape[2]
        self.span(self.key, rows, self.offset, length).copy_(key)
        self.span(self.value, rows, self.offset, length).copy_(value)

    def zero_grads(self) -> None:
        """Clear the gradient accumulators (before a sequence's backward over its chunks)."""
        if self.grad_key is None or self.grad_value is None:
            raise RuntimeError("KVCache.zero_grads: this cache has no gradient accumulators")
        self.grad_key.zero_()
        self.grad_value.zero_()


class _ExtendCache(torch.autograd.Function):
    """Forward: write the chunk's K/V into the cache, return the cache's ``[0, offset + T)`` (prefix + chunk).
    Backward: the prefix part of the gradient goes into the accumulators; the chunk's own part plus what
    the later chunks accumulated at its positions is the gradient of its K/V."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache.write(key, value)
        ctx.cache = cache  # type: ignore[attr-defined]
        end, rows = cache.offset + key.shape[2], key.shape[0]
        return cache.span(cache.key, rows, 0, end), cache.span(cache.value, rows, 0, end)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_key: torch.Tensor,
        grad_value: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        cache: KVCache = ctx.cache  # type: ignore[attr-defined]
        if cache.grad_key is None or cache.grad_value is None:
            raise RuntimeError("chunked attention backward needs a KVCache with gradient accumulators")
        off = cache.offset
        own = []
        for grad, acc in ((grad_key, cache.grad_key), (grad_value, cache.grad_value)):
            acc = acc[: grad.shape[0]]
            acc[:, :, :off] += grad[:, :, :off]
            own.append((grad[:, :, off:] + acc[:, :, off : grad.shape[2]]).to(grad.dtype))
        return own[0], own[1], None


def extend_cache(key: torch.Tensor, value: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys/values a chunk attends over (see :class:`_ExtendCache`)."""
    return _ExtendCache.apply(key, value, cache)
