"""The layers of a Llama decoder, written to match Hugging Face ``LlamaForCausalLM`` numerically.

The model is a flat list ``[Embedding, Block x n_layers, Head]``; every layer maps hidden states
to hidden states (the Head maps them to a loss, or to logits), so any contiguous slice is a
pipeline stage. Parameters are created uninitialised: ``sysx.model.llama`` initialises them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sysx.model.attention import (
    SDPA_GQA,
    KVCache,
    apply_rope,
    attend,
    chunk_attention,
    extend_cache,
    merge_heads,
    rope_cos_sin,
)
from sysx.model.config import ModelConfig
from sysx.model.loss import IGNORE_INDEX, chunked_cross_entropy

__all__ = ["IGNORE_INDEX", "MLP", "SDPA_GQA", "Attention", "Block", "Embedding", "Head", "RMSNorm"]


def _linear(in_features: int, out_features: int, device: torch.device | str | None, dtype: torch.dtype) -> nn.Linear:
    """A bias-free ``nn.Linear`` whose weight is left uninitialised (no wasted default init)."""
    device = torch.get_default_device() if device is None else device
    return nn.utils.skip_init(nn.Linear, in_features, out_features, bias=False, device=device, dtype=dtype)


class RMSNorm(nn.Module):
    """RMS normalisation as in HF ``LlamaRMSNorm``: fp32 variance, cast back, then scale."""

    def __init__(
        self, dim: int, eps: float, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE (:mod:`sysx.model.attention`).

    ``forward(x)`` attends over the whole sequence ``x``; ``forward(x, kv)`` treats ``x`` as the chunk of
    a longer sequence starting at ``kv.offset`` and attends over the K/V cached for the chunks before it.
    Both share the projections, RoPE and :func:`~sysx.model.attention.attend`.
    """

    def __init__(
        self, cfg: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = _linear(cfg.dim, cfg.n_heads * cfg.head_dim, device, dtype)
        self.k_proj = _linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, device, dtype)
        self.v_proj = _linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, device, dtype)
        self.o_proj = _linear(cfg.n_heads * cfg.head_dim, cfg.dim, device, dtype)

    def _heads(self, proj: nn.Linear, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        return proj(x).view(bsz, seq_len, n_heads, self.head_dim).transpose(1, 2)

    def _rope(self, x: torch.Tensor, offset: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables of positions ``offset .. offset + T - 1`` of a sequence of ``total`` positions."""
        cos, sin = rope_cos_sin(self.cfg, total, x.device, x.dtype)
        if total != x.shape[1]:  # a chunk: narrow dispatches the same op whatever the offset
            return cos.narrow(0, offset, x.shape[1]), sin.narrow(0, offset, x.shape[1])
        return cos, sin

    def keys_values(
        self, x: torch.Tensor, offset: int = 0, total: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values ``[B, Hkv, T, D]`` of ``x`` at positions ``offset ..`` of ``total``."""
        cos, sin = self._rope(x, offset, x.shape[1] if total is None else total)
        k = self._heads(self.k_proj, x, self.n_kv_heads)
        v = self._heads(self.v_proj, x, self.n_kv_heads)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, kv: KVCache | None = None) -> torch.Tensor:
        offset, total = (0, x.shape[1]) if kv is None else (kv.offset, kv.seq_len)
        q = apply_rope(self._heads(self.q_proj, x, self.n_heads), *self._rope(x, offset, total))
        k, v = self.keys_values(x, offset, total)
        scale = self.head_dim**-0.5
        if kv is None:
            y = merge_heads(attend(q, k, v, scale=scale))
        else:
            y = chunk_attention(q, *extend_cache(k, v, kv), scale)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(
        self, cfg: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.gate_proj = _linear(cfg.dim, cfg.ffn_dim, device, dtype)
        self.up_proj = _linear(cfg.dim, cfg.ffn_dim, device, dtype)
        self.down_proj = _linear(cfg.ffn_dim, cfg.dim, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _EmbeddingFp32Grad(torch.autograd.Function):
    """``F.embedding`` whose weight gradient is summed in fp32 and rounded to the weight's dtype once.

    PyTorch's CPU kernel accumulates a 16-bit embedding gradient in 16 bits: a frequent token's
    thousands of contributions lose their small terms and its gradient norm comes out 3-8% low in
    bf16. The sums run over the distinct ids of the batch only, so the fp32 temporary is at most
    ``tokens x dim``, never ``vocab x dim``.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        input_ids: torch.Tensor,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(input_ids)
        ctx.weight_meta = (weight.shape, weight.dtype)  # type: ignore[attr-defined]
        return F.embedding(input_ids, weight)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_out: torch.Tensor,
    ) -> tuple[None, torch.Tensor]:
        (input_ids,) = ctx.saved_tensors  # type: ignore[attr-defined]
        shape, dtype = ctx.weight_meta  # type: ignore[attr-defined]
        ids, slot = torch.unique(input_ids.reshape(-1), return_inverse=True)
        sums = torch.zeros(ids.numel(), shape[1], dtype=torch.float32, device=grad_out.device)
        sums.index_add_(0, slot, grad_out.reshape(-1, shape[1]).to(torch.float32))
        grad = torch.zeros(shape, dtype=dtype, device=grad_out.device)
        grad[ids] = sums.to(dtype)
        return None, grad


class Embedding(nn.Module):
    """Token embedding: ``input_ids [B, T] -> hidden [B, T, dim]``.

    With a 16-bit weight on the CPU the weight gradient is accumulated in fp32
    (:class:`_EmbeddingFp32Grad`); CUDA's kernel already accumulates in fp32, and fp32 weights take
    PyTorch's own path, bit for bit.
    """

    def __init__(
        self, cfg: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim, device=device, dtype=dtype))
        self.tied_to_head = False  # set by LlamaModel when the Head reuses this weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.requires_grad and w.element_size() < 4 and w.device.type == "cpu" and torch.is_grad_enabled():
            return _EmbeddingFp32Grad.apply(input_ids, w)
        return F.embedding(input_ids, w)


class Block(nn.Module):
    """One pre-norm decoder block: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``.

    Positions are ``0..T-1`` of the input, or with a :class:`~sysx.model.attention.KVCache` ``kv`` the
    input is the chunk of a longer sequence at ``kv.offset`` (attention over the cached K/V of the
    chunks before it; everything else is position-wise). The RoPE tables are computed (and cached) inside.
    """

    def __init__(
        self, cfg: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device, dtype=dtype)
        self.attn = Attention(cfg, device=device, dtype=dtype)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device, dtype=dtype)
        self.mlp = MLP(cfg, device=device, dtype=dtype)

    def forward(self, hidden: torch.Tensor, kv: KVCache | None = None) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden), kv)
        return hidden + self.mlp(self.mlp_norm(hidden))

    @torch.no_grad()
    def cache_keys_values(self, hidden: torch.Tensor, kv: KVCache) -> None:
        """Write the rotated K/V of the chunk ``hidden`` (at ``kv.offset``) into ``kv``: what its forward
        writes, from the block input alone (rebuilding the cache for a backward over the chunks)."""
        kv.write(*self.attn.keys_values(self.attn_norm(hidden), kv.offset, kv.seq_len))


class Head(nn.Module):
    """Final RMSNorm, the output projection and the loss.

    ``labels[b, t]`` is the target of position ``t`` (already shifted, nanoGPT style);
    ``IGNORE_INDEX`` (-100) marks positions that do not count. The loss runs over chunks of tokens
    (:func:`~sysx.model.loss.chunked_cross_entropy`), so the logits of all tokens never exist at once.
    """

    def __init__(
        self, cfg: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device, dtype=dtype)
        self.lm_head = _linear(cfg.dim, cfg.vocab_size, device, dtype)
        self.tied_to_embedding = False  # set by LlamaModel when lm_head.weight is the Embedding's weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [B, T, dim] -> logits [B, T, vocab]`` in the parameters' dtype."""
        return self.lm_head(self.norm(hidden))

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy over the positions whose label is not -100 (fp32 softmax).

        Without ``labels`` it returns the logits instead, so ``run_layers`` can run inference.
        """
        if labels is None:
            return self.logits(hidden)
        return chunked_cross_entropy(hidden, self.lm_head.weight, labels, features=self.norm)
