"""The Head's cross-entropy over chunks of tokens: the logits of all tokens never exist at once.

``chunked_cross_entropy(hidden, weight, labels, features=norm)`` equals
``F.cross_entropy(F.linear(norm(hidden), weight).float(), labels, ignore_index=-100)``, forward and
backward, but works on :func:`loss_chunk_tokens` tokens at a time; its temporaries are bounded by
:data:`LOSS_CHUNK_LOGITS` logits whatever the number of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
# Logits computed at once (the chunk is this many logits' worth of tokens). 2**24 bounds the loss's own
# temporaries at ~200-260 MiB whatever the vocabulary, and keeps every chunk's matmul large enough to run
# at full speed on a GPU (130 tokens x 4096 x 128256 for Llama-3, 524 tokens for a 32000 vocabulary).
LOSS_CHUNK_LOGITS = 1 << 24
# At most this many tokens per chunk: with a small vocabulary the logits bound alone would allow tens of
# thousands of tokens, whose fp32 norm temporaries (and logits) then grow with the sequence again.
LOSS_CHUNK_TOKENS = 1024


def loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the loss for a vocabulary of ``vocab_size``."""
    return max(1, min(LOSS_CHUNK_TOKENS, LOSS_CHUNK_LOGITS // vocab_size))


def loss_workspace_bytes(tokens: int, vocab_size: int, dim: int, dtype: torch.dtype) -> int:
    """Transient bytes of the loss's forward + backward over ``tokens`` (what the planner budgets):
    a chunk's logits (its dtype + fp32 + the fp32 and cast gradient), the norm's fp32 temporaries of
    a chunk, the weight-gradient accumulator and the hidden-state gradient."""
    tau = torch.empty((), dtype=dtype).element_size()
    chunk = min(tokens, loss_chunk_tokens(vocab_size))
    logits = chunk * vocab_size * (2 * tau + 8)
    norm = 4 * chunk * dim * 4
    return logits + norm + vocab_size * dim * tau + tokens * dim * tau


def _rows(tokens: int, chunk: int) -> range:
    return range(0, tokens, chunk)


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log-sum-exp of each row and ``lse - target logit`` (0 where the label is ignored)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    valid = labels != IGNORE_INDEX
    target = logits.gather(1, torch.where(valid, labels, 0)[:, None])[:, 0]
    return lse, torch.where(valid, lse - target, 0.0)


def _logits_grad(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(softmax - onehot(label)) * scale`` per valid row (0 for ignored rows), in the logits' dtype."""
    valid = labels != IGNORE_INDEX
    grad = torch.exp(logits.float() - lse[:, None])
    rows = torch.arange(labels.shape[0], device=labels.device)
    grad[rows, torch.where(valid, labels, 0)] -= 1.0
    grad *= torch.where(valid, scale, 0.0)[:, None]
    return grad.to(logits.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``F.linear(features(hidden), weight)`` (see docs/architecture.md)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        features: nn.Module,
        chunk: int,
        *feature_params: torch.Tensor,
    ) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for s in _rows(x.shape[0], chunk):
            lse[s : s + chunk], losses = _token_losses(F.linear(features(x[s : s + chunk]), weight), y[s : s + chunk])
            total += losses.sum()
        ctx.save_for_backward(hidden, weight, labels, lse, *feature_params)
        ctx.features, ctx.chunk = features, chunk  # type: ignore[attr-defined]
        return total / (y != IGNORE_INDEX).sum().clamp_min(1)  # no trained token: loss 0, not 0/0

    @staticmethod
    @once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_loss: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse, *params = ctx.saved_tensors  # type: ignore[attr-defined]
        features, chunk = ctx.features, ctx.chunk  # type: ignore[attr-defined]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]  # type: ignore[attr-defined]
        need_p = ctx.needs_input_grad[5:]  # type: ignore[attr-defined]
        x = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        scale = grad_loss.float() / (y != IGNORE_INDEX).sum().clamp_min(1)
        grad_x = torch.empty_like(x) if need_x else None
        grad_w: torch.Tensor | None = None
        grad_p: list[torch.Tensor | None] = [None] * len(params)
        for s in _rows(x.shape[0], chunk):
            xc = x[s : s + chunk].detach().requires_grad_(need_x)
            with torch.enable_grad():
                h = features(xc)
            logits = F.linear(h.detach(), weight)
            g = _logits_grad(logits, lse[s : s + chunk], y[s : s + chunk], scale)
            del logits
            if need_w:
                grad_w = g.t() @ h.detach() if grad_w is None else grad_w.addmm_(g.t(), h.detach())
            _backprop_features(
                h, g @ weight, xc, params, need_p, grad_p, None if grad_x is None else grad_x[s : s + chunk]
            )
        return (None if grad_x is None else grad_x.view_as(hidden), grad_w, None, None, None, *grad_p)


def _backprop_features(
    h: torch.Tensor,
    grad_h: torch.Tensor,
    xc: torch.Tensor,
    params: Sequence[torch.Tensor],
    need_p: Sequence[bool],
    grad_p: list[torch.Tensor | None],
    grad_x: torch.Tensor | None,
) -> None:
    """Backpropagate ``grad_h`` through the features of one chunk: its input gradient into ``grad_x``,
    the feature parameters' gradients summed into ``grad_p``."""
    wanted = [p for p, need in zip(params, need_p) if need]
    inputs = ([xc] if grad_x is not None else []) + wanted
    if not inputs:
        return
    grads = list(torch.autograd.grad(h, inputs, grad_h))
    if grad_x is not None:
        grad_x.copy_(grads.pop(0))
    for i, need in enumerate(need_p):
        if need:
            g, before = grads.pop(0), grad_p[i]
            grad_p[i] = g if before is None else before.add_(g)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    features: nn.Module,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of the logits ``F.linear(features(hidden), weight)`` against ``labels``
    (-100 = ignored), ``chunk_tokens`` tokens at a time (default :func:`loss_chunk_tokens`)."""
    chunk = chunk_tokens or loss_chunk_tokens(weight.shape[0])
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, features, chunk, *features.parameters())
