"""Parameter counts and FLOP counts of a :class:`ModelConfig` (for partitioning and MFU).

Convention (PaLM, Chowdhery et al. 2022, Appendix B; the same as nanoGPT's ``estimate_mfu``):
training costs ``6 * N + 12 * L * dim * T`` FLOPs per token, where ``N`` is the number of
parameters that take part in matrix multiplies (the Blocks' projections and the output
projection; not the input embedding lookup, not the RMSNorm weights), ``L`` the number of
Blocks and ``T`` the sequence length. ``2 * N`` is the forward matmul cost (one multiply-add per
weight per token), backward costs twice the forward, and ``12 * L * dim * T`` is attention's
``Q K^T`` and ``A V`` (``2 * 2 * dim * T`` forward per layer, times 3 for training), counted for
the full ``T x T`` square as PaLM does (causal kernels skip about half of it). Elementwise work
(norms, RoPE, SwiGLU gate, softmax, loss) is not counted.
"""

from __future__ import annotations

from sysx.model.config import ModelConfig


def block_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one Block that take part in matmuls (q, k, v, o, gate, up, down)."""
    hd = cfg.head_dim
    attn = cfg.dim * cfg.n_heads * hd * 2 + cfg.dim * cfg.n_kv_heads * hd * 2
    mlp = 3 * cfg.dim * cfg.ffn_dim
    return attn + mlp


def block_params(cfg: ModelConfig) -> int:
    """Every weight of one Block: its matmul weights and its two RMSNorm weights."""
    return block_matmul_params(cfg) + 2 * cfg.dim


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters of the model (a tied output projection counted once)."""
    embedding = cfg.vocab_size * cfg.dim
    block = block_params(cfg)
    head = cfg.dim + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    return embedding + cfg.n_layers * block + head


def matmul_params(cfg: ModelConfig) -> int:
    """``N`` of the FLOP formula: Block projections plus the output projection (tied or not)."""
    return cfg.n_layers * block_matmul_params(cfg) + cfg.vocab_size * cfg.dim


def layer_flops(cfg: ModelConfig, seq_len: int) -> list[float]:
    """Forward FLOPs per token of each flat layer ``[Embedding, Block x L, Head]``.

    Embedding: 0 (a lookup). Block: ``2 * block_matmul_params + 4 * dim * seq_len``. Head:
    ``2 * vocab * dim``. Three times their sum is :func:`flops_per_token`.
    """
    block = 2.0 * block_matmul_params(cfg) + 4.0 * cfg.dim * seq_len
    head = 2.0 * cfg.vocab_size * cfg.dim
    return [0.0] + [block] * cfg.n_layers + [head]


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token: ``6 * N + 12 * L * dim * seq_len`` (PaLM)."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.dim * seq_len
