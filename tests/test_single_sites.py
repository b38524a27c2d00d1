"""Saved-activation sites: capture/replay is bit-exact at every level and skips what it saved;
int8 compression's error bound and bytes; the meta-device profile used for planning."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from sysx.model import get_preset
from sysx.model.llama import build_model, make_layer
from sysx.single import act_capture
from sysx.single.act_capture import (
    ReplayMismatch,
    ReplayStats,
    SlotLayout,
    backward_replayed,
    level_layouts,
    run_captured,
)
from sysx.single.act_policy import N_LEVELS
from sysx.single.compress import compression_error, dequantize, packed_nbytes, quantize
from sysx.single.op_profile import profile_layer

CFG = get_preset("tiny")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def block_and_reference():
    torch.manual_seed(0)
    block = build_model(CFG, seed=3).layers[1]
    x = torch.randn(2, 48, CFG.dim)
    g = torch.randn(2, 48, CFG.dim)
    xr = x.clone().requires_grad_(True)
    block(xr).backward(g)
    ref = {n: p.grad.clone() for n, p in block.named_parameters()}
    for p in block.parameters():
        p.grad = None
    return block, x, g, ref, xr.grad.clone()


def _run_level(block, x, g, layout, profile, stats=None):
    for p in block.parameters():
        p.grad = None
    slot = torch.empty(layout.nbytes, dtype=torch.uint8)
    y = run_captured(block, x, profile, layout, slot)
    gx = backward_replayed(block, g, profile, layout, slot, stats=stats)
    return y, gx, {n: p.grad.clone() for n, p in block.named_parameters()}


@pytest.mark.parametrize("level", range(N_LEVELS))
def test_replay_is_bit_exact_and_skips_saved_sites(block_and_reference, level: int) -> None:
    block, x, g, ref, ref_gx = block_and_reference
    profile = profile_layer(block, x, model_dim=CFG.dim)
    layout = SlotLayout.build(profile, profile.level_sites(level))
    stats = ReplayStats()
    y, gx, grads = _run_level(block, x, g, layout, profile, stats)
    assert torch.equal(y, block(x).detach())
    assert torch.equal(gx, ref_gx)
    for name, grad in grads.items():
        assert torch.equal(grad, ref[name]), name
    saved = len(profile.level_sites(level))
    assert stats.reused_sites == saved
    assert stats.recomputed_sites == len(profile.sites) - saved
    if level == N_LEVELS - 1:
        assert stats.recomputed_flops == 0.0  # "everything": nothing is recomputed
    if level == 0:
        assert stats.reused_sites == 0


def test_levels_grow_in_bytes_and_in_recompute_avoided(block_and_reference) -> None:
    block, x, *_ = block_and_reference
    profile = profile_layer(block, x, model_dim=CFG.dim)
    layouts = level_layouts(profile)
    sizes = [layout.nbytes for layout in layouts]
    assert sizes == sorted(sizes) and len(set(sizes)) == N_LEVELS
    assert layouts[0].nbytes == pytest.approx(x.numel() * 4, abs=256)  # layer input only
    flops = [sum(s.flops for s in profile.sites if s.index in layout.sites) for layout in layouts]
    assert flops == sorted(flops) and flops[1] > 0  # attention saved first
    cats = {s.category for s in profile.sites}
    assert cats == {"attention", "narrow_matmul", "wide_matmul", "elementwise"}


def test_int8_compressed_replay_is_close_and_smaller(block_and_reference) -> None:
    block, x, g, ref, ref_gx = block_and_reference
    profile = profile_layer(block, x, model_dim=CFG.dim)
    plain = SlotLayout.build(profile, profile.level_sites(3))
    packed = SlotLayout.build(profile, profile.level_sites(3), compress=True)
    assert packed.nbytes < 0.5 * plain.nbytes
    _, gx, grads = _run_level(block, x, g, packed, profile)
    rel = max(float((grads[n] - ref[n]).norm() / ref[n].norm()) for n in ref)
    assert rel < 0.05  # int8 activations perturb weight gradients by a few percent at most
    assert float((gx - ref_gx).norm() / ref_gx.norm()) < 0.05


def test_int8_error_bound_and_bytes() -> None:
    torch.manual_seed(1)
    x = torch.randn(64, 256) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different scales
    err = compression_error(x)
    assert err["max_rel_to_row_absmax"] <= 1 / 254 + 1e-6
    assert err["bytes_packed"] == packed_nbytes((64, 256)) == 64 * 256 + 64 * 4
    assert err["ratio"] == pytest.approx(4 * 256 / (256 + 4))
    zeros = torch.zeros(3, 40)
    assert torch.equal(dequantize(quantize(zeros), (3, 40), torch.float32), zeros)
    bf = torch.randn(10, 100).to(torch.bfloat16)
    back = dequantize(quantize(bf), (10, 100), torch.bfloat16)
    assert (
        back.dtype == torch.bfloat16
        and float((back.float() - bf.float()).abs().max()) <= float(bf.float().abs().max()) / 100
    )


def test_meta_profile_matches_the_real_one() -> None:
    """The planner profiles on ``meta`` (any model size, no memory): same bytes per category as a real run."""
    real_block = build_model(CFG, seed=0).layers[1]
    real = profile_layer(real_block, torch.randn(2, 32, CFG.dim), model_dim=CFG.dim)
    meta = profile_layer(
        make_layer(CFG, 1, device="meta"), torch.empty(2, 32, CFG.dim, device="meta"), model_dim=CFG.dim
    )
    for cat in ("attention", "narrow_matmul", "wide_matmul", "elementwise"):
        assert sum(s.nbytes for s in real.sites_in([cat])) == sum(s.nbytes for s in meta.sites_in([cat])), cat
        assert sum(s.flops for s in real.sites_in([cat])) == sum(s.flops for s in meta.sites_in([cat])), cat


def test_replay_names_a_changed_op_sequence(block_and_reference) -> None:
    block, x, g, *_ = block_and_reference
    profile = profile_layer(block, x, model_dim=CFG.dim)
    layout = SlotLayout.build(profile, profile.level_sites(2))
    slot = torch.empty(layout.nbytes, dtype=torch.uint8)
    run_captured(block, x, profile, layout, slot)
    changed = dataclasses.replace(profile, ops=(*profile.ops[:3], "aten.not_this_op.default", *profile.ops[4:]))
    expected = rf"op #3 is {re.escape(profile.ops[3])} but the profiled forward had aten\.not_this_op"
    with pytest.raises(ReplayMismatch, match=expected) as raised:
        backward_replayed(block, g, changed, layout, slot)
    assert str(raised.value).endswith("single.policy=input")  # the fix, a key the config has
    with pytest.raises(ValueError, match="not cacheable"):
        SlotLayout.build(profile, {10_000})


def test_a_level_that_saves_nothing_runs_no_dispatch_mode(block_and_reference, dispatch_mode_calls) -> None:
    """Save level 0 keeps only the layer input: its forward and recompute run plain, without the
    per-op Python call of Capture and Replay (the H200's 50M window forward was host-bound in it)."""
    block, x, g, *_ = block_and_reference
    profile = profile_layer(block, x, model_dim=CFG.dim)
    calls = dispatch_mode_calls
    stats = ReplayStats()
    _run_level(block, x, g, SlotLayout.build(profile, ()), profile, stats)
    assert calls == {"Capture": 0, "Replay": 0}
    assert stats.recomputed_sites == len(profile.sites) and stats.reused_sites == 0
    assert stats.recomputed_flops == sum(s.flops for s in profile.sites)
    _run_level(block, x, g, SlotLayout.build(profile, profile.level_sites(1)), profile)
    assert calls["Capture"] == calls["Replay"] == len(profile.ops)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def test_graph_bytes_are_what_the_autograd_graph_holds(block_and_reference) -> None:
    """The profile's graph bytes against autograd's own record of a forward: the tensors its nodes
    saved (their ``_saved_*`` attributes), each storage once (256-byte aligned), less the Block's
    weights and its input; the meta profile (its fused-attention stand-in) counts the same."""
    from sysx.single.plan_costs import meta_layer_profile

    block, x, *_ = block_and_reference
    profile = profile_layer(block, x, model_dim=CFG.dim, count_graph=True)
    xin = x.clone().requires_grad_(True)
    y = block(xin)
    outside = {_storage(p) for p in block.parameters()} | {_storage(xin)}
    saved: dict[int, int] = {}
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo += [n for n, _ in node.next_functions]
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            value = getattr(node, name)
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and _storage(t) not in outside:
                    saved[_storage(t)] = t.untyped_storage().nbytes()
    assert len(saved) > 10
    assert profile.graph_bytes == sum((n + 255) // 256 * 256 for n in saved.values())
    meta = meta_layer_profile(CFG, x.shape[1], x.dtype, x.shape[0], x.shape[1], count_graph=True)
    assert meta.graph_bytes == profile.graph_bytes
    assert profile_layer(block, x, model_dim=CFG.dim).graph_bytes is None  # counted only when asked
    everything = SlotLayout.build(profile, profile.level_sites(N_LEVELS - 1))
    assert act_capture.kept_graph_layout(profile).nbytes < everything.nbytes


def test_a_kept_graph_reads_what_it_saved_from_the_slot(block_and_reference) -> None:
    """A kept forward's backward gives the plain backward's gradients bit for bit, and it reads what
    the graph saved from the block's slot: spoil the slot after the forward and the gradients change."""
    block, x, g, ref, ref_gx = block_and_reference
    profile = profile_layer(block, x, model_dim=CFG.dim, count_graph=True)
    layout = act_capture.kept_graph_layout(profile)
    grads = []
    for spoil in (False, True):
        for p in block.parameters():
            p.grad = None
        slot = torch.zeros(layout.nbytes, dtype=torch.uint8)
        y = torch.empty_like(x)
        graph = act_capture.run_keeping_graph(block, x, layout, slot, out=y)
        assert torch.equal(y, block(x))
        if spoil:  # the region after the input: what the graph saved
            slot[layout.input.nbytes :].view(torch.float32)[:] = 0.5
        gx = act_capture.backward_kept(graph, g)
        grads.append((gx, {n: p.grad.clone() for n, p in block.named_parameters()}))
    (gx, params), (spoiled_gx, _) = grads
    assert torch.equal(gx, ref_gx) and all(torch.equal(params[n], ref[n]) for n in ref)
    assert not torch.equal(spoiled_gx, ref_gx)
