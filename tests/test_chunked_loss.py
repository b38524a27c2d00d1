"""The Head's chunked cross-entropy (sysx.model.loss): equal to ``F.cross_entropy`` on the full fp32 logits,
values and gradients (fp32, <= 1e-5), with ignored labels and tied weights; no op ever makes a tensor
of all tokens' logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sysx.model import ModelConfig, build_model
from sysx.model import loss as loss_module
from sysx.model.layers import RMSNorm
from sysx.model.loss import chunked_cross_entropy, loss_chunk_tokens, loss_workspace_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

N_TOKENS, DIM, VOCAB = 60, 16, 37


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, RMSNorm, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, N_TOKENS // 3, DIM, generator=gen).requires_grad_(True)
    weight = (0.5 * torch.randn(VOCAB, DIM, generator=gen)).requires_grad_(True)
    norm = RMSNorm(DIM, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.2 * torch.randn(DIM, generator=gen))
    labels = torch.randint(0, VOCAB, (3, N_TOKENS // 3), generator=gen)
    labels[0, 2:9] = -100
    labels[2, -1] = -100
    return hidden, weight, norm, labels


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("chunk", [1, 7, 20, 59, 1000])
def test_chunked_loss_equals_cross_entropy_on_the_full_logits(chunk: int) -> None:
    hidden, weight, norm, labels = _inputs()
    full = F.cross_entropy(F.linear(norm(hidden), weight).float().view(-1, VOCAB), labels.view(-1), ignore_index=-100)
    want = torch.autograd.grad(full * 3.0, (hidden, weight, norm.weight))  # a scaled loss, as with loss scaling
    got_loss = chunked_cross_entropy(hidden, weight, labels, features=norm, chunk_tokens=chunk)
    got = torch.autograd.grad(got_loss * 3.0, (hidden, weight, norm.weight))
    assert abs(got_loss.item() - full.item()) <= 1e-5 * abs(full.item())
    for name, a, b in zip(("hidden", "weight", "norm weight"), got, want):
        assert _max_diff(a, b) <= 1e-5, name


def test_ignored_labels_do_not_count_and_only_needed_gradients_are_made() -> None:
    hidden, weight, norm, labels = _inputs(seed=1)
    all_ignored_but_one = torch.full_like(labels, -100)
    all_ignored_but_one[1, 3] = labels[1, 3]
    loss = chunked_cross_entropy(hidden, weight, all_ignored_but_one, features=norm, chunk_tokens=4)
    logits = F.linear(norm(hidden[1, 3]), weight).float()
    assert abs(loss.item() - (torch.logsumexp(logits, 0) - logits[labels[1, 3]]).item()) <= 1e-5
    (g_hidden,) = torch.autograd.grad(loss, hidden)
    assert g_hidden[1, 3].abs().sum() > 0 and g_hidden.abs().sum() == g_hidden[1, 3].abs().sum()
    frozen = weight.detach()
    grads = torch.autograd.grad(chunked_cross_entropy(hidden, frozen, labels, features=norm, chunk_tokens=4), hidden)
    assert grads[0].shape == hidden.shape


def test_head_chunks_a_large_vocabulary_and_matches_the_full_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig(
        vocab_size=96, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64, tie_embeddings=True
    )
    model = build_model(cfg, seed=3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 24), generator=gen)
    labels = torch.randint(0, 96, (2, 24), generator=gen)
    labels[1, :5] = -100
    full = F.cross_entropy(model(ids).float().view(-1, 96), labels.view(-1), ignore_index=-100)
    full.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_LOGITS", 96 * 5)  # 5 tokens per chunk
    assert loss_chunk_tokens(96) == 5
    with _LargestLogits(96) as seen:
        loss = model.loss(ids, labels)
        loss.backward()
    assert abs(loss.item() - full.item()) <= 1e-5
    for name, p in model.named_parameters():  # the tied weight gets the embedding's and the head's share
        assert _max_diff(p.grad, want[name]) <= 1e-5, name
    assert seen.largest <= 5 * 96 < 48 * 96  # never all 48 tokens' logits at once


class _LargestLogits(TorchDispatchMode):
    """Records the largest logits-shaped tensor (last dimension = the vocabulary) any op returns, forward and backward."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view (e.g. the weight transposed) allocates nothing
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def test_bf16_chunked_loss_stays_close_to_the_full_logits() -> None:
    hidden, weight, norm, labels = _inputs(seed=2)
    norm16 = RMSNorm(DIM, 1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        norm16.weight.copy_(norm.weight)
    h16 = hidden.detach().bfloat16().requires_grad_(True)
    w16 = weight.detach().bfloat16().requires_grad_(True)
    full = F.cross_entropy(F.linear(norm16(h16), w16).float().view(-1, VOCAB), labels.view(-1), ignore_index=-100)
    want = torch.autograd.grad(full, (h16, w16))
    loss = chunked_cross_entropy(h16, w16, labels, features=norm16, chunk_tokens=8)
    got = torch.autograd.grad(loss, (h16, w16))
    assert loss.dtype == torch.float32 and abs(loss.item() - full.item()) <= 1e-5 * abs(full.item())
    assert all(_max_diff(a.float(), b.float()) <= 2e-2 for a, b in zip(got, want))


def test_the_planner_budget_of_the_loss_is_bounded_for_llama3() -> None:
    """The loss's own temporaries at 8K tokens and 32K tokens differ only by the hidden-state gradient."""
    at_8k = loss_workspace_bytes(8192, 128256, 4096, torch.bfloat16)
    at_32k = loss_workspace_bytes(32768, 128256, 4096, torch.bfloat16)
    assert loss_chunk_tokens(128256) == 130
    assert at_32k - at_8k == (32768 - 8192) * 4096 * 2
    assert at_8k < 1.5 * 2**30 < 8192 * 128256 * 10  # < 1.5 GiB with the weight gradient; full logits: 9.8 GiB
