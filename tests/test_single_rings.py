"""Ring buffers carved from one device buffer: the slot protocol (refill only after release) and the
per-region version counters that let autograd read weights while gradients accumulate next door."""

from __future__ import annotations

import pytest
import torch

from sysx import device as dev
from sysx.single.rings import ALIGN, DeviceArena, Ring, RingError, typed

CPU = torch.device("cpu")


def test_arena_regions_are_aligned_disjoint_views_of_one_buffer() -> None:
    arena = DeviceArena(CPU, {"a": 1000, "b": 3, "c": 4096})
    a, b, c = arena.region("a"), arena.region("b"), arena.region("c")
    assert (a.numel(), b.numel(), c.numel()) == (1000, 3, 4096)
    base = arena.buffer.data_ptr()
    offs = [t.data_ptr() - base for t in (a, b, c)]
    assert all(o % ALIGN == 0 for o in offs) and offs == sorted(offs)
    assert offs[1] >= 1000 and offs[2] >= offs[1] + 3
    assert arena.nbytes == sum(arena.describe().values())
    a.fill_(1)
    c.fill_(3)
    assert (
        int(arena.buffer[offs[0]]) == 1 and int(arena.buffer[offs[2]]) == 3 and b.untyped_storage().data_ptr() == base
    )
    with pytest.raises(KeyError, match="no region"):
        arena.region("d")


def test_slot_protocol_refill_only_after_release() -> None:
    arena = DeviceArena(CPU, {"ring": 3 * 1024})
    log: list = []
    ring = Ring("w", arena.region("ring"), 3, 1000, log=log)
    s = dev.Stream(CPU)
    ring.fill(0, "L0", s, lambda raw: raw.fill_(7))
    with pytest.raises(RingError, match="refilled with 'L3' while it is ready"):
        ring.fill(0, "L3", s, lambda raw: raw.zero_())
    with pytest.raises(RingError, match="asked for 'L1'"):
        ring.acquire(0, "L1", s)
    raw = ring.acquire(0, "L0", s)
    assert int(raw[0]) == 7
    with pytest.raises(RingError, match="in_use"):
        ring.fill(0, "L3", s, lambda raw: raw.zero_())
    ring.release(0, s)
    ring.fill(0, "L3", s, lambda raw: raw.fill_(9))
    assert ring.state(0) == "ready" and ring.key(0) == "L3"
    with pytest.raises(RingError, match="released while ready"):
        ring.release(0, s)
    # keep=True leaves data readable for a second consumer of the same key
    ring.acquire(0, "L3", s)
    ring.release(0, s, keep=True)
    assert int(ring.acquire(0, "L3", s)[0]) == 9
    ring.release(0, s)
    assert [op for _, op, _, _ in log] == [
        "fill",
        "acquire",
        "release",
        "fill",
        "acquire",
        "release",
        "acquire",
        "release",
    ]
    assert ring.slot_of(7) == 1 and len(ring) == 3


def _block_grads(buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor], grad_out: torch.Tensor) -> torch.Tensor:
    """A Block whose input, weights and grads are the three given 1-D buffers: backward of ``grad_out``.
    (A Block, not the Head: the Head's chunked loss makes all its gradients in one autograd node, so
    nothing saved is read after they accumulate.)"""
    from sysx.model import FlatLayout, get_preset
    from sysx.model.llama import make_layer

    cfg = get_preset("tiny")
    block = make_layer(cfg, 1)
    layout = FlatLayout.from_modules([block])
    x_buf, w_buf, g_buf = buffers
    layout.bind([block], w_buf)
    layout.bind_grads([block], g_buf)
    x = x_buf.view(2, 16, cfg.dim).detach().requires_grad_(True)
    block(x).backward(grad_out)
    return g_buf.clone()


def test_regions_have_their_own_autograd_version_counters() -> None:
    """A block's input and weights in some regions, its grads accumulated into another region of the
    same buffer: autograd must not mistake the accumulation for an in-place change of saved tensors."""
    from sysx.model import FlatLayout, get_preset
    from sysx.model.llama import make_layer

    cfg = get_preset("tiny")
    n_w = FlatLayout.from_modules([make_layer(cfg, 1)]).numel
    n_x = 2 * 16 * cfg.dim
    torch.manual_seed(0)
    x0, w0 = torch.randn(n_x), torch.randn(n_w) * 0.1
    grad_out = torch.randn(2, 16, cfg.dim)
    expected = _block_grads((x0.clone(), w0.clone(), torch.zeros(n_w)), grad_out)  # separate tensors

    shared = torch.zeros(n_x + 2 * n_w)  # plain views of one buffer share its version counter
    shared[:n_x], shared[n_x : n_x + n_w] = x0, w0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _block_grads((shared[:n_x], shared[n_x : n_x + n_w], shared[n_x + n_w :]), grad_out)

    arena = DeviceArena(CPU, {"x": n_x * 4, "w": n_w * 4, "g": n_w * 4})
    x, w, g = (typed(arena.region(name), torch.float32) for name in ("x", "w", "g"))
    x.copy_(x0)
    w.copy_(w0)
    g.zero_()
    assert torch.equal(_block_grads((x, w, g), grad_out), expected)
