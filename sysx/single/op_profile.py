"""Profiling a layer's forward pass op by op, for planning the saved activations.

A *site* is one op of a layer's forward pass whose output is a fresh tensor (not a view, not an
in-place update): a matmul, the attention kernel, a norm, a SwiGLU product... :func:`profile_layer`
runs a layer once under a recording mode and returns its sites (op, category, output shapes,
bytes, FLOPs and optionally measured time) as a :class:`LayerProfile`; :mod:`sysx.single.act_capture`
saves chosen sites and replays them in the recompute. On the ``meta`` device (planning a model that
does not fit here) the attention call is emulated, because ``meta`` would otherwise decompose it
into the unfused math kernel.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten

from sysx.model.attention import KVCache
from sysx.single.act_policy import level_categories
from sysx.single.compress import rows_of
from sysx.single.graph_pack import GraphPacker

if TYPE_CHECKING:
    from sysx.model.config import ModelConfig

COMPRESS_MIN_ROW = 32  # rows shorter than this are not worth an fp32 scale each
_ALIAS_OPS = {"aten._unsafe_view.default", "aten.lift_fresh.default", "aten.alias.default"}

CHUNK_ATTENTION_OP = "sysx.chunk_attention.default"  # sysx.model.attention.chunk_attention: always causal


def _is_attention(name: str) -> bool:
    return (
        "scaled_dot_product" in name
        or "flash_attention" in name
        or "efficient_attention" in name
        or "cudnn_attention" in name
        or name == CHUNK_ATTENTION_OP
    ) and "backward" not in name


def _is_matmul(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 1 and parts[1] in {"mm", "addmm", "bmm", "baddbmm"}


def _is_alias(func: torch._ops.OpOverload) -> bool:
    if str(func) in _ALIAS_OPS:
        return True
    return any(r.alias_info is not None for r in func._schema.returns)


def _dense_extent(t: torch.Tensor) -> int | None:
    """``numel`` when ``t``'s strides lay it out densely without overlap (any dim order), else None."""
    if t.numel() == 0:
        return 0
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expect = 1
    for stride, size in dims:
        if stride != expect:
            return None
        expect *= size
    return t.numel()


@dataclass(frozen=True)
class TensorMeta:
    """Shape, strides and dtype of one op output (what a slot entry must reproduce)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    dense: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        dense = _dense_extent(t) is not None
        return cls(
            tuple(t.shape),
            tuple(t.stride()) if dense else tuple(torch.empty(t.shape, device="meta").stride()),
            t.dtype,
            dense,
        )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype, device="meta").element_size()


@dataclass(frozen=True)
class Site:
    """One cacheable op of a layer's forward pass."""

    index: int  # position in the layer's op sequence
    op: str
    category: str  # one of act_policy.CATEGORIES
    outputs: tuple[TensorMeta | None, ...]  # per pytree leaf; None for a leaf replayed as a constant
    consts: tuple[object, ...]  # those constant leaves (ints, None, RNG-state tensors), as produced
    spec: TreeSpec  # pytree spec of the op's return value
    flops: float
    seconds: float | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor outputs, uncompressed."""
        return sum(m.nbytes for m in self.outputs if m is not None)

    def compressible(self, k: int) -> bool:
        """Whether output ``k`` may be int8-compressed: the main (first) floating output with long rows."""
        m = self.outputs[k]
        return (
            k == 0
            and m is not None
            and m.dtype.is_floating_point
            and len(m.shape) >= 2
            and rows_of(m.shape)[1] >= COMPRESS_MIN_ROW
        )


@dataclass(frozen=True)
class LayerProfile:
    """The op sequence of one layer forward at one input shape, with its cacheable sites."""

    ops: tuple[str, ...]
    sites: tuple[Site, ...]
    input: TensorMeta
    seconds: float | None = None  # measured time of the whole forward
    # bytes of the region a kept forward graph packs its saved tensors into, besides the layer's
    # input and weights (:mod:`sysx.single.graph_pack`); None unless asked for (``count_graph``) and
    # for a sequence chunk, whose graph the window never keeps (``act_capture.run_keeping_graph``)
    graph_bytes: int | None = None

    def sites_in(self, categories: Iterable[str]) -> tuple[Site, ...]:
        """The sites of the given categories."""
        cats = set(categories)
        return tuple(s for s in self.sites if s.category in cats)

    def level_sites(self, level: int) -> frozenset[int]:
        """Site indices saved at ``level``."""
        return frozenset(s.index for s in self.sites_in(level_categories(level)))

    def flops(self) -> float:
        """FLOPs of the matmul and attention sites."""
        return sum(s.flops for s in self.sites)


# ------------------------------------------------------------------------------------- profiling


def _flops(name: str, args: Sequence[Any], kwargs: dict[str, Any], func: torch._ops.OpOverload, out: object) -> float:
    """FLOPs of a matmul or attention op from its operand shapes (0 for anything else)."""
    short = name.split(".")[1] if "." in name else name
    if short in {"mm", "addmm"}:
        a, b = (args[1], args[2]) if short == "addmm" else (args[0], args[1])
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if short in {"bmm", "baddbmm"}:
        a, b = (args[1], args[2]) if short == "baddbmm" else (args[0], args[1])
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if _is_attention(name):
        names = [a.name for a in func._schema.arguments]
        bound = dict(zip(names, args))
        bound.update(kwargs)
        q, k, v = bound["query"], bound["key"], bound["value"]
        causal = name == CHUNK_ATTENTION_OP or bool(bound.get("is_causal", False))
        return attention_flops(tuple(q.shape), tuple(k.shape), tuple(v.shape), causal)
    return 0.0


def attention_flops(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...], causal: bool) -> float:
    """Forward FLOPs of ``softmax(q k^T) v`` for ``q [B, H, Sq, D]``: ``2 B H Sq Sk (D + Dv)``; causal
    (the queries being the last ``Sq`` of the ``Sk`` positions) counts the ``Sq (Sk - Sq / 2)`` pairs
    kept, half of them for ``Sq == Sk``."""
    b, h, sq, d = q
    sk, dv = k[-2], v[-1]
    pairs = sq * (sk - sq / 2) if causal else sq * sk
    return 2.0 * b * h * pairs * (d + dv)


def category_of(name: str, out_leaves: Sequence[object], model_dim: int) -> str:
    """Site category of an op: attention, narrow/wide matmul (output width <= / > ``model_dim``), elementwise."""
    if _is_attention(name):
        return "attention"
    if _is_matmul(name):
        first = next((t for t in out_leaves if isinstance(t, torch.Tensor)), None)
        width = first.shape[-1] if first is not None and first.dim() else 0
        return "narrow_matmul" if width <= model_dim else "wide_matmul"
    return "elementwise"


def _is_const(leaf: object, op: str) -> bool:
    """Leaves replayed as recorded instead of saved: non-tensors, and the tiny integer RNG-state tensors
    (philox seed/offset) that fused attention kernels return (unused without dropout)."""
    if not isinstance(leaf, torch.Tensor):
        return True
    return _is_attention(op) and not leaf.is_floating_point() and leaf.numel() <= 16


def _const_value(leaf: object) -> object:
    return leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf


class _Recorder(TorchDispatchMode):
    def __init__(self, model_dim: int, timed: bool, graph: GraphPacker | None = None) -> None:
        super().__init__()
        self.model_dim = model_dim
        self.timed = timed
        self.ops: list[str] = []
        self.sites: list[Site] = []
        self.paused = False
        self.graph = graph

    def add_site(self, name: str, out: object, flops: float, seconds: float | None) -> None:
        leaves, spec = tree_flatten(out)
        const = [_is_const(t, name) for t in leaves]
        metas = tuple(None if c else TensorMeta.of(t) for t, c in zip(leaves, const))
        consts = tuple(_const_value(t) if c else None for t, c in zip(leaves, const))
        self.sites.append(
            Site(len(self.ops), name, category_of(name, leaves, self.model_dim), metas, consts, spec, flops, seconds)
        )
        self.ops.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        name = str(func)
        cuda = self.timed and any(isinstance(a, torch.Tensor) and a.is_cuda for a in tree_flatten(args)[0])
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0 if self.timed else None
        leaves = tree_flatten(out)[0]
        if _is_alias(func) or not any(isinstance(t, torch.Tensor) for t in leaves):
            self.ops.append(name)
        else:
            self.add_site(name, out, _flops(name, args, kwargs, func, out), seconds)
        return out


class _MetaAttention(TorchFunctionMode):
    """On ``meta``, stand in for the fused attention kernel (out + fp32 log-sum-exp) instead of the math path."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            if q.is_meta:
                b, h, sq, _ = q.shape
                self.recorder.paused = True
                # fused kernels write [B, S, H, D] memory and return its [B, H, S, D] view
                out = torch.empty((b, sq, h, v.shape[-1]), dtype=q.dtype, device="meta").transpose(1, 2)
                lse = torch.empty((b, h, sq), dtype=torch.float32, device="meta")
                self.recorder.paused = False
                flops = attention_flops(
                    tuple(q.shape), tuple(k.shape), tuple(v.shape), bool(kwargs.get("is_causal", False))
                )
                self.recorder.add_site("aten._scaled_dot_product_fused_attention(meta)", (out, lse), flops, None)
                graph = self.recorder.graph
                if graph is not None:  # what a fused kernel saves for its backward
                    for t in (q, k, v, out, lse):
                        graph.pack(t)
                return out.requires_grad_(q.requires_grad)
        return func(*args, **kwargs)


def run_layer(layer: nn.Module, x: torch.Tensor, kv: KVCache | None) -> torch.Tensor:
    """``layer(x)``, or ``layer(x, kv)`` for a chunk of a longer sequence."""
    return layer(x) if kv is None else layer(x, kv)


def profile_layer(
    layer: nn.Module,
    x: torch.Tensor,
    *,
    model_dim: int,
    measure: bool = False,
    repeats: int = 3,
    kv: KVCache | None = None,
    count_graph: bool = False,
) -> LayerProfile:
    """Run ``layer(x)`` (autograd on, as the executor does) and list its ops and cacheable sites.

    With ``measure`` each site's time is the median of ``repeats`` timed runs (the GPU is
    synchronised around every op: use it for profiling only). A first untimed run fills any
    caches the layer keeps (e.g. RoPE tables) so that they do not show up as sites. With ``kv``
    ``x`` is a sequence chunk (a Block's ``forward(x, kv)``; see :func:`profile_cache`). With
    ``count_graph`` (and whole sequences) one more forward counts the bytes a kept graph packs
    (:attr:`LayerProfile.graph_bytes`); it costs a third of an untimed profile, so only a plan that
    may keep graphs asks.
    """
    x = x.detach().requires_grad_(x.is_floating_point())
    with torch.enable_grad():
        run_layer(layer, x, kv)  # warm caches (RoPE tables, kernels)
        runs = repeats if measure else 1
        profiles: list[_Recorder] = []
        walls: list[float] = []
        for _ in range(runs):
            rec = _Recorder(model_dim, timed=measure)
            t0 = time.perf_counter()
            _record(layer, x, kv, rec)
            walls.append(time.perf_counter() - t0)
            profiles.append(rec)
        graph_bytes = _graph_bytes(layer, x, model_dim) if count_graph and kv is None else None
    first = profiles[0]
    sites = list(first.sites)
    if measure:
        for k, site in enumerate(sites):
            times = sorted(p.sites[k].seconds or 0.0 for p in profiles)
            sites[k] = Site(
                site.index,
                site.op,
                site.category,
                site.outputs,
                site.consts,
                site.spec,
                site.flops,
                times[len(times) // 2],
            )
    return LayerProfile(
        tuple(first.ops),
        tuple(sites),
        TensorMeta.of(x),
        sorted(walls)[len(walls) // 2] if measure else None,
        graph_bytes,
    )


def _record(layer: nn.Module, x: torch.Tensor, kv: KVCache | None, rec: _Recorder) -> None:
    """One forward under ``rec`` (and the fused-attention stand-in on ``meta``)."""
    with _MetaAttention(rec) if x.is_meta else contextlib.nullcontext(), rec:
        run_layer(layer, x, kv)


def _graph_bytes(layer: nn.Module, x: torch.Tensor, model_dim: int) -> int:
    """:attr:`LayerProfile.graph_bytes` from one more forward, its own: a pack hook changes the op
    sequence autograd dispatches (an output saved without a hook costs a ``detach``), so the
    recorded runs, which capture and replay compare against, run without one."""
    graph = GraphPacker([*layer.parameters(), x], x.device)
    with graph.hooks():
        _record(layer, x, None, _Recorder(model_dim, timed=False, graph=graph))
    return graph.done()


# (sequences per chunk b, sequence-chunk length C) -> profile of one Block computing b x C tokens
Profiler = Callable[[int, int], LayerProfile]


def profile_cache(
    cfg: ModelConfig, b: int, seq_len: int, seq_chunk: int, dtype: torch.dtype, device: torch.device | str
) -> KVCache | None:
    """The K/V cache a Block profiled on a sequence chunk runs with (None for whole sequences): zeros,
    the chunk in the middle of the sequence, so its attention has the mean length of a chunk's
    attention (``C (S / 2)`` query-key pairs) and its time and FLOPs are the mean."""
    if seq_chunk >= seq_len:
        return None
    shape = (b, cfg.n_kv_heads, seq_len, cfg.head_dim)
    zeros = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)]
    return KVCache(zeros[0], zeros[1], offset=(seq_len - seq_chunk) // 2)


def device_profiler(
    cfg: ModelConfig,
    seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    measure: bool,
    count_graph: bool = False,
) -> Profiler:
    """Profile a Block with random weights on ``b`` sequences of ``C`` tokens on the training device
    (cached per size); ``count_graph``: with the bytes a kept graph packs.

    The planner sizes chunks from ``meta`` profiles and calls this only for the sizes it chose, so
    the block is built once and each input is drawn directly on the device in ``dtype`` (no fp32
    host copy per size). A ``torch.cuda.OutOfMemoryError`` propagates: to the planner it means the
    size does not fit.
    """
    from sysx.model.llama import make_layer

    cache: dict[tuple[int, int], LayerProfile] = {}
    blocks: list[nn.Module] = []

    def block() -> nn.Module:
        if not blocks:
            gen = torch.Generator(device="cpu").manual_seed(1234)
            layer = make_layer(cfg, 1, dtype=torch.float32, device="cpu")
            with torch.no_grad():
                for p in layer.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02 + (1.0 if p.dim() == 1 else 0.0))
            blocks.append(layer.to(device=device, dtype=dtype))
        return blocks[0]

    def run(b: int, seq_chunk: int) -> LayerProfile:
        # untimed, a profile lists ops and bytes, which the shapes decide: kept for the process, so a
        # sweep's points and repeated jobs of the same shape need not run the Block again
        sizes = cache if measure else _UNMEASURED.setdefault((cfg, seq_len, dtype, str(device), count_graph), {})
        if (b, seq_chunk) not in sizes:
            gen = torch.Generator(device=device).manual_seed(1234 + b)
            x = torch.randn((b, min(seq_chunk, seq_len), cfg.dim), generator=gen, device=device, dtype=dtype)
            kv = profile_cache(cfg, b, seq_len, seq_chunk, dtype, device)
            sizes[(b, seq_chunk)] = profile_layer(
                block(), x, model_dim=cfg.dim, measure=measure, kv=kv, count_graph=count_graph
            )
        return sizes[(b, seq_chunk)]

    return run


# untimed device profiles by (model, seq_len, dtype, device, count_graph), then (b, seq_chunk)
_UNMEASURED: dict[tuple[ModelConfig, int, torch.dtype, str, bool], dict[tuple[int, int], LayerProfile]] = {}
