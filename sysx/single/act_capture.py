"""Saving chosen op outputs of a layer in the forward pass and reusing them when it is recomputed.

Running a layer under :class:`Capture` copies the outputs of the selected sites (ops profiled by
:mod:`sysx.single.op_profile`) into an activation slot: one contiguous byte buffer laid out by
:class:`SlotLayout`, the layer input first. Recomputing the layer for backward under :class:`Replay`
hands back those saved outputs instead of running the ops (like PyTorch's selective checkpointing,
but the saved values live in our ring slot and travel to host memory and back): the skipped ops
cost nothing, autograd still records their backward, and every op that was not saved is recomputed
from the layer input. The result is bit-identical to a plain recompute.

Both passes run with autograd enabled, so forward and recompute dispatch the very same op
sequence; :class:`Replay` checks each op against the profile and names the first mismatch. A layout
that saves no site (save level 0, the layer input only) runs neither mode: its forward runs without
autograd and its recompute is a plain one, as the pipeline's are. The modes cost one Python call per
aten op (11-17 us each on the CPU machine, about as much as a tiny Block's compute), and on the H200
they made the 50M window's forward host-bound (``profiling/RESULTS.md``).

A block that never leaves the device and whose sequences are whole needs neither: it keeps its
forward's autograd graph until its backward (:func:`run_keeping_graph`, :func:`backward_kept`), which
recomputes nothing and saves less than level 'everything' (a slot of 10.1 against 15.9 MiB for a tiny
Block at 1024 tokens; :attr:`~sysx.single.op_profile.LayerProfile.graph_bytes`). What the graph saves is
packed into the block's slot (:mod:`sysx.single.graph_pack`), so the memory stays planned. The
planner chooses it when every block fits the device and ``single.keep_graph=true`` (off by default
until a GPU has run it: ``docs/architecture.md``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from sysx.model.attention import KVCache
from sysx.single.act_policy import N_LEVELS
from sysx.single.compress import dequantize, packed_nbytes, quantize_into
from sysx.single.graph_pack import GraphPacker, slot_align, storage_key
from sysx.single.op_profile import LayerProfile, TensorMeta, run_layer

# ----------------------------------------------------------------------------------- slot layout


@dataclass(frozen=True)
class SlotEntry:
    """Where one saved tensor lives in a slot."""

    offset: int
    nbytes: int
    meta: TensorMeta
    compressed: bool


@dataclass(frozen=True)
class SlotLayout:
    """Placement of the layer input and the saved sites' outputs in one activation slot."""

    input: SlotEntry
    entries: dict[int, tuple[SlotEntry | None, ...]]  # site index -> one entry per pytree leaf
    nbytes: int
    sites: frozenset[int]

    @classmethod
    def build(cls, profile: LayerProfile, sites: Iterable[int], *, compress: bool = False) -> SlotLayout:
        """Lay out the input then every selected site (in op order), each tensor aligned (:data:`~sysx.single.graph_pack.ALIGN`)."""
        chosen = frozenset(sites)
        known = {s.index for s in profile.sites}
        unknown = sorted(chosen - known)
        if unknown:
            raise ValueError(f"SlotLayout: site indices {unknown} are not cacheable sites of this layer")
        off = 0
        inp = SlotEntry(0, profile.input.nbytes, profile.input, False)
        off = slot_align(inp.nbytes)
        entries: dict[int, tuple[SlotEntry | None, ...]] = {}
        for site in profile.sites:
            if site.index not in chosen:
                continue
            row: list[SlotEntry | None] = []
            for k, meta in enumerate(site.outputs):
                if meta is None:
                    row.append(None)
                    continue
                packed = compress and site.compressible(k)
                n = packed_nbytes(meta.shape) if packed else meta.nbytes
                row.append(SlotEntry(off, n, meta, packed))
                off += slot_align(n)
            entries[site.index] = tuple(row)
        return cls(inp, entries, off, chosen)

    def view(self, slot: torch.Tensor, entry: SlotEntry) -> torch.Tensor:
        """The tensor ``entry`` occupies in ``slot`` (uint8), with its dtype, shape and strides."""
        raw = slot[entry.offset : entry.offset + entry.nbytes]
        if entry.compressed:
            return raw
        flat = raw.view(entry.meta.dtype)
        if entry.meta.dense:
            return flat.as_strided(entry.meta.shape, entry.meta.stride)
        return flat.view(entry.meta.shape)


def level_layouts(profile: LayerProfile, *, compress: bool = False) -> list[SlotLayout]:
    """The slot layout of every save level 0..N_LEVELS-1."""
    return [SlotLayout.build(profile, profile.level_sites(level), compress=compress) for level in range(N_LEVELS)]


# ---------------------------------------------------------------------------------- the two modes


class ReplayMismatch(RuntimeError):
    """The recompute dispatched a different op sequence from the profiled forward pass."""


_NAMES: dict[object, str] = {}  # aten overload -> its name, as the profile lists it (str() is slow)


def _name(func: object) -> str:
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func)
    return name


def _check_op(profile: LayerProfile, idx: int, func: object, where: str) -> None:
    name = _name(func)
    if idx < len(profile.ops) and profile.ops[idx] == name:
        return
    expected = profile.ops[idx] if idx < len(profile.ops) else "<end of the profiled forward>"
    raise ReplayMismatch(
        f"{where}: op #{idx} is {name} but the profiled forward had {expected}; the layer's op sequence "
        f"changed between passes (data-dependent control flow or a cache filled mid-run). Save the layer "
        f"input only, which replays nothing, for this model: single.policy=input"
    )


class Capture(TorchDispatchMode):
    """Forward pass: copy the outputs of ``layout.sites`` into ``slot`` as they are produced."""

    def __init__(self, profile: LayerProfile, layout: SlotLayout, slot: torch.Tensor) -> None:
        super().__init__()
        self.profile, self.layout, self.slot = profile, layout, slot
        self.idx = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        idx = self.idx
        self.idx += 1
        _check_op(self.profile, idx, func, "Capture")
        row = self.layout.entries.get(idx)
        if row is not None:
            leaves = tree_flatten(out)[0]
            for entry, leaf in zip(row, leaves):
                if entry is None:
                    continue
                if entry.compressed:
                    quantize_into(leaf, self.layout.view(self.slot, entry))
                else:
                    self.layout.view(self.slot, entry).copy_(leaf)
        return out


@dataclass
class ReplayStats:
    """What recomputes did: cacheable sites recomputed vs. reused from the slot, and their FLOPs."""

    recomputed_sites: int = 0
    reused_sites: int = 0
    recomputed_flops: float = 0.0
    reused_flops: float = 0.0


class Replay(TorchDispatchMode):
    """Recompute: return the saved outputs of ``layout.sites`` from ``slot``; run every other op."""

    def __init__(
        self, profile: LayerProfile, layout: SlotLayout, slot: torch.Tensor, stats: ReplayStats | None = None
    ) -> None:
        super().__init__()
        self.profile, self.layout, self.slot = profile, layout, slot
        self.sites = {s.index: s for s in profile.sites}
        self.stats = stats if stats is not None else ReplayStats()
        self.idx = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        idx = self.idx
        self.idx += 1
        _check_op(self.profile, idx, func, "Replay")
        row = self.layout.entries.get(idx)
        site = self.sites.get(idx)
        if row is None:
            if site is not None:
                self.stats.recomputed_sites += 1
                self.stats.recomputed_flops += site.flops
            return func(*args, **(kwargs or {}))
        assert site is not None
        self.stats.reused_sites += 1
        self.stats.reused_flops += site.flops
        leaves: list[object] = []
        for entry, const in zip(row, site.consts):
            if entry is None:
                leaves.append(const)
            elif entry.compressed:
                t = dequantize(self.layout.view(self.slot, entry), entry.meta.shape, entry.meta.dtype)
                if entry.meta.dense and t.stride() != entry.meta.stride:
                    t = torch.empty_strided(entry.meta.shape, entry.meta.stride, dtype=t.dtype, device=t.device).copy_(
                        t
                    )
                leaves.append(t)
            else:
                leaves.append(self.layout.view(self.slot, entry).detach())
        return tree_unflatten(leaves, site.spec)


def run_captured(
    layer: nn.Module,
    x: torch.Tensor,
    profile: LayerProfile,
    layout: SlotLayout,
    slot: torch.Tensor,
    *,
    kv: KVCache | None = None,
) -> torch.Tensor:
    """Forward ``layer(x)`` with autograd on, saving ``x`` and the layout's sites into ``slot``; returns the
    detached output. The layer reads its input from the slot (contiguous, as profiled and as replayed,
    whatever the strides of ``x``, e.g. a sequence chunk of the residual stream)."""
    saved = layout.view(slot, layout.input)
    saved.copy_(x)
    if not layout.sites:  # nothing to capture: the recompute runs plain and needs no op sequence
        with torch.no_grad():
            return run_layer(layer, saved, kv)
    xin = saved.detach().requires_grad_(True)
    with torch.enable_grad(), Capture(profile, layout, slot):
        y = run_layer(layer, xin, kv)
    return y.detach()


def backward_replayed(
    layer: nn.Module,
    grad_out: torch.Tensor,
    profile: LayerProfile,
    layout: SlotLayout,
    slot: torch.Tensor,
    *,
    stats: ReplayStats | None = None,
    kv: KVCache | None = None,
) -> torch.Tensor:
    """Recompute ``layer`` from the input saved in ``slot`` (reusing the saved sites), backpropagate
    ``grad_out`` (parameter grads accumulate into ``.grad``), and return the gradient of the input.
    With ``kv`` the slot holds a sequence chunk: ``kv`` must hold the K/V of the whole sequence and its
    gradient accumulators what the later chunks sent back (see :mod:`sysx.model.attention`)."""
    x = layout.view(slot, layout.input).detach().requires_grad_(True)
    with torch.enable_grad():
        if layout.sites:
            with Replay(profile, layout, slot, stats):
                y = run_layer(layer, x, kv)
        else:  # a plain recompute: every site, as Replay would count it
            y = run_layer(layer, x, kv)
            if stats is not None:
                stats.recomputed_sites += len(profile.sites)
                stats.recomputed_flops += profile.flops()
        torch.autograd.backward(y, grad_out)
    assert x.grad is not None
    return x.grad


def kept_graph_layout(profile: LayerProfile) -> SlotLayout:
    """The slot of a block that keeps its graph: the layer input, then the region its graph packs
    its saved tensors into (:attr:`LayerProfile.graph_bytes` bytes, :mod:`sysx.single.graph_pack`)."""
    if profile.graph_bytes is None:
        raise ValueError(
            "kept_graph_layout: the profile has no graph bytes; profile with count_graph=True (whole sequences only)"
        )
    inp = SlotEntry(0, profile.input.nbytes, profile.input, False)
    return SlotLayout(inp, {}, slot_align(inp.nbytes) + profile.graph_bytes, frozenset())


@dataclass
class KeptGraph:
    """A block's forward kept for its backward: the input it read (a view of its slot) and its output,
    the autograd graph between them reading what it saved from the slot."""

    input: torch.Tensor
    output: torch.Tensor


def run_keeping_graph(
    layer: nn.Module, x: torch.Tensor, layout: SlotLayout, slot: torch.Tensor, *, out: torch.Tensor
) -> KeptGraph:
    """Forward ``layer(x)`` into ``out`` (which may be ``x``) with autograd on, reading ``x`` from
    ``slot`` and packing what the graph saves into the rest of it (``layout``: :func:`kept_graph_layout`);
    returns the graph for :func:`backward_kept`. The graph reads the layer's weights and ``slot``:
    neither may change before the backward."""
    saved = layout.view(slot, layout.input)
    saved.copy_(x)
    xin = saved.detach().requires_grad_(True)
    packer = GraphPacker([*layer.parameters(), xin], slot.device, slot[slot_align(layout.input.nbytes) : layout.nbytes])
    with torch.enable_grad(), packer.hooks():
        y = layer(xin)
    packer.done()
    out.copy_(y.detach())
    # the backward needs the output's graph, not its values (whatever the graph reads is in the slot):
    # its storage goes now, or every block would hold a residual stream no plan counts until its backward
    if storage_key(y) not in packer.skip:  # unless the output is a view of the input or a weight
        y.untyped_storage().resize_(0)
    return KeptGraph(xin, y)


def backward_kept(graph: KeptGraph, grad_out: torch.Tensor) -> torch.Tensor:
    """Backpropagate ``grad_out`` through a kept forward (parameter grads accumulate into ``.grad``) and
    return the gradient of its input."""
    torch.autograd.backward(graph.output, grad_out)
    grad = graph.input.grad
    assert grad is not None
    return grad
