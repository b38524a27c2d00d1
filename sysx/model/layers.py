"""The layers of a Llama decoder, written to match Hugging Face ``LlamaForCausalLM`` numerically.

The model is a flat list ``[Embedding, Block x n_layers, Head]``; every layer maps hidden states
to hidden states (the Head maps them to a loss, or to logits), so any contiguous slice is a
pipeline stage. Parameters are created uninitialised: ``sysx.model.llama`` initialises them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from sysx.model.config import ModelConfig

IGNORE_INDEX = -100


# torch >= 2.5: scaled_dot_product_attention takes fewer K/V heads than query heads (enable_gqa)
SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _linear(in_features: int, out_features: int, device: torch.device | str | None, dtype: torch.dtype) -> nn.Linear:
    """A bias-free ``nn.Linear`` whose weight is left uninitialised (no wasted default init)."""
    device = torch.get_default_device() if device is None else device
    return nn.utils.skip_init(nn.Linear, in_features, out_features, bias=False, device=device, dtype=dtype)


class RMSNorm(nn.Module):
    """RMS normalisation as in HF ``LlamaRMSNorm``: fp32 variance, cast back, then scale."""

    def __init__(self, dim: int, eps: float, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)


@functools.lru_cache(maxsize=64)
def rope_cos_sin(head_dim: int, theta: float, seq_len: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``(cos, sin)`` of shape ``[seq_len, head_dim]`` for positions ``0..seq_len-1``.

    Computed like HF ``LlamaRotaryEmbedding`` (inverse frequencies in fp32 on the CPU, angles in
    fp32 on ``device``, halves concatenated, then cast to ``dtype``) and cached per shape/device.
    """
    with torch.inference_mode(False), torch.no_grad():
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        inv_freq = inv_freq.to(device)
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


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE, computed by ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.q_proj = _linear(cfg.dim, cfg.n_heads * cfg.head_dim, device, dtype)
        self.k_proj = _linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, device, dtype)
        self.v_proj = _linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, device, dtype)
        self.o_proj = _linear(cfg.n_heads * cfg.head_dim, cfg.dim, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        q = self.q_proj(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(self.head_dim, self.rope_theta, seq_len, x.device, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = self.n_heads // self.n_kv_heads
        gqa: dict[str, bool] = {}
        if n_rep > 1 and SDPA_GQA:
            # Each KV head serves n_rep consecutive query heads (HF ``repeat_kv``); the flash kernels
            # read the shared K/V directly instead of n_rep materialised copies.
            gqa = {"enable_gqa": True}
        elif n_rep > 1:
            k = k[:, :, None].expand(bsz, self.n_kv_heads, n_rep, seq_len, self.head_dim).reshape(
                bsz, self.n_heads, seq_len, self.head_dim)
            v = v[:, :, None].expand(bsz, self.n_kv_heads, n_rep, seq_len, self.head_dim).reshape(
                bsz, self.n_heads, seq_len, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim ** -0.5, **gqa)
        y = y.transpose(1, 2).reshape(bsz, seq_len, self.n_heads * self.head_dim)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
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
    def forward(ctx: torch.autograd.function.FunctionCtx, input_ids: torch.Tensor,  # type: ignore[override]
                weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(input_ids)
        ctx.weight_meta = (weight.shape, weight.dtype)  # type: ignore[attr-defined]
        return F.embedding(input_ids, weight)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,  # type: ignore[override]
                 grad_out: torch.Tensor) -> tuple[None, torch.Tensor]:
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

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
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

    Positions are ``0..T-1`` of the input; the RoPE tables are computed (and cached) inside.
    """

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device, dtype=dtype)
        self.attn = Attention(cfg, device=device, dtype=dtype)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device, dtype=dtype)
        self.mlp = MLP(cfg, device=device, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden))
        return hidden + self.mlp(self.mlp_norm(hidden))


class Head(nn.Module):
    """Final RMSNorm, the output projection and the loss.

    ``labels[b, t]`` is the target of position ``t`` (already shifted, nanoGPT style);
    ``IGNORE_INDEX`` (-100) marks positions that do not count.
    """

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
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
        logits = self.logits(hidden)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX)
