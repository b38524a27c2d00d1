"""Layers -> forward stages -> backward sub-stages -> ranks (pure data, no torch).

:func:`partition_layers` cuts a model's flat layer list into contiguous forward stages of even cost
and each of them into ``split`` backward sub-stages (a :class:`Partition`; a manual cut is a list of
layer counts). A :class:`RankAssignment` says which rank runs each: :func:`coupled_assignment` (the
baselines) or :func:`sysx_assignment` (SysX's decoupled one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def unit_label(stage: int, sub: int = -1) -> str:
    """The one spelling of a parameter unit: ``s3`` (forward stage) or ``s5.1`` (sub-stage ``(5, 1)``)."""
    return f"s{stage}" if sub < 0 else f"s{stage}.{sub}"


class PartitionError(ValueError):
    """An impossible partition or assignment request (the message names the values and the fix)."""


@dataclass(frozen=True)
class Partition:
    """Contiguous cut of ``n_layers`` layers into forward stages and backward sub-stages.

    ``stage_bounds[s]:stage_bounds[s+1]`` are forward stage ``s``'s layers;
    ``sub_bounds[s][k]:sub_bounds[s][k+1]`` are backward sub-stage ``(s, k)``'s layers (absolute
    layer indices, ``sub_bounds[s][0] == stage_bounds[s]``). The checkpoint of sub-stage
    ``(s, k)`` is the input activation of its first layer, produced during the forward of ``s``.
    """

    layer_costs: tuple[float, ...]
    stage_bounds: tuple[int, ...]
    sub_bounds: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.layer_costs)
        b = self.stage_bounds
        if len(b) < 2 or b[0] != 0 or b[-1] != n or any(b[i] >= b[i + 1] for i in range(len(b) - 1)):
            raise PartitionError(f"stage_bounds {b} must increase strictly from 0 to n_layers={n}")
        if len(self.sub_bounds) != len(b) - 1:
            raise PartitionError(f"sub_bounds has {len(self.sub_bounds)} entries for {len(b) - 1} stages")
        split = len(self.sub_bounds[0]) - 1
        for s, sb in enumerate(self.sub_bounds):
            if len(sb) - 1 != split:
                raise PartitionError(
                    f"stage {s} has {len(sb) - 1} sub-stages, stage 0 has {split}: all need the same split"
                )
            if sb[0] != b[s] or sb[-1] != b[s + 1] or any(sb[i] >= sb[i + 1] for i in range(len(sb) - 1)):
                raise PartitionError(f"sub_bounds[{s}]={sb} must increase strictly from {b[s]} to {b[s + 1]}")

    @property
    def n_layers(self) -> int:
        """Number of layers in the model."""
        return len(self.layer_costs)

    @property
    def n_stages(self) -> int:
        """Number of forward stages ``Nsf``."""
        return len(self.stage_bounds) - 1

    @property
    def split(self) -> int:
        """Backward sub-stages per forward stage ``d``."""
        return len(self.sub_bounds[0]) - 1

    @property
    def head_alone(self) -> bool:
        """Whether the last layer (the Head) is a forward stage of its own with d = 1: where its
        input gradient can move to its forward (``ScheduleOptions.head_igrad``)."""
        return self.n_stages > 1 and self.split == 1 and len(self.stage_layers(self.n_stages - 1)) == 1

    def stage_layers(self, s: int) -> range:
        """Layer indices of forward stage ``s``."""
        return range(self.stage_bounds[s], self.stage_bounds[s + 1])

    def sub_layers(self, s: int, k: int) -> range:
        """Layer indices of backward sub-stage ``(s, k)``."""
        return range(self.sub_bounds[s][k], self.sub_bounds[s][k + 1])

    def layers(self, s: int, k: int = -1) -> range:
        """``stage_layers(s)`` for ``k == -1``, else ``sub_layers(s, k)``."""
        return self.stage_layers(s) if k < 0 else self.sub_layers(s, k)

    def next_sub(self, s: int, k: int) -> tuple[int, int] | None:
        """The backward sub-stage whose input gradient ``(s, k)`` consumes as its output gradient
        (``None`` for the model's last sub-stage, which starts from the loss)."""
        if k < self.split - 1:
            return (s, k + 1)
        if s < self.n_stages - 1:
            return (s + 1, 0)
        return None

    def stage_cost(self, s: int) -> float:
        """Sum of the layer costs of forward stage ``s``."""
        return float(sum(self.layer_costs[i] for i in self.stage_layers(s)))

    def sub_cost(self, s: int, k: int) -> float:
        """Sum of the layer costs of backward sub-stage ``(s, k)``."""
        return float(sum(self.layer_costs[i] for i in self.sub_layers(s, k)))

    def with_split(self, split: int) -> Partition:
        """The same forward stages, each cut into ``split`` balanced sub-stages."""
        return partition_layers(
            self.layer_costs,
            self.n_stages,
            split=split,
            stage_sizes=[len(self.stage_layers(s)) for s in range(self.n_stages)],
        )

    def describe(self, names: Sequence[str] | None = None) -> str:
        """A table: stage, layers, share of the total cost, and the sub-stages."""
        total = sum(self.layer_costs) or 1.0
        lines = [f"{'stage':>6} {'layers':>12} {'cost':>12} {'share':>7}   sub-stages (layers)"]
        for s in range(self.n_stages):
            r = self.stage_layers(s)
            label = f"{r.start}-{r.stop - 1}"
            if names:
                label = f"{names[r.start]}..{names[r.stop - 1]}" if len(r) > 1 else names[r.start]
            subs = " ".join(
                f"{s}.{k}:{self.sub_layers(s, k).start}-{self.sub_layers(s, k).stop - 1}" for k in range(self.split)
            )
            c = self.stage_cost(s)
            lines.append(f"{s:>6} {label:>12} {c:>12.4g} {100 * c / total:>6.1f}%   {subs}")
        return "\n".join(lines)


def _min_max_bottleneck(prefix: np.ndarray, parts: int) -> float:
    """Smallest possible largest part when cutting the sequence behind ``prefix`` into ``parts``."""
    n = len(prefix) - 1
    inf = float("inf")
    # best[i] = minimal bottleneck covering the first i items with the current number of parts
    best = np.full(n + 1, inf)
    best[0] = 0.0
    for p in range(1, parts + 1):
        new = np.full(n + 1, inf)
        for i in range(p, n - (parts - p) + 1):
            j = np.arange(p - 1, i)
            cand = np.maximum(best[j], prefix[i] - prefix[j])
            new[i] = cand.min()
        best = new
    return float(best[n])


def _balanced_cut(costs: Sequence[float], parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous non-empty pieces: minimal largest piece, then minimal sum of squares."""
    n = len(costs)
    if parts == 1:
        return [n]
    c = np.asarray(costs, dtype=np.float64)
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    bound = _min_max_bottleneck(prefix, parts)
    tol = 1e-9 * max(1.0, abs(bound))
    inf = float("inf")
    best = np.full(n + 1, inf)
    best[0] = 0.0
    choice = np.zeros((parts + 1, n + 1), dtype=np.int64)
    for p in range(1, parts + 1):
        new = np.full(n + 1, inf)
        for i in range(p, n - (parts - p) + 1):
            j = np.arange(p - 1, i)
            piece = prefix[i] - prefix[j]
            cand = np.where(piece <= bound + tol, best[j] + piece * piece, inf)
            a = int(np.argmin(cand))
            new[i] = cand[a]
            choice[p, i] = j[a]
        best = new
    sizes: list[int] = []
    i = n
    for p in range(parts, 0, -1):
        start = int(choice[p, i])
        sizes.append(i - start)
        i = start
    return sizes[::-1]


def _check_sizes(sizes: Sequence[int], total: int, what: str, fix: str) -> list[int]:
    sizes = [int(x) for x in sizes]
    if any(x <= 0 for x in sizes) or sum(sizes) != total:
        raise PartitionError(f"{what} {sizes} must be positive and sum to {total} (they sum to {sum(sizes)}); {fix}")
    return sizes


def partition_layers(
    layer_costs: Sequence[float],
    n_stages: int,
    *,
    split: int = 1,
    stage_sizes: Sequence[int] | None = None,
    sub_sizes: Sequence[Sequence[int]] | None = None,
    n_ranks: int | None = None,
) -> Partition:
    """Cut layers into ``n_stages`` forward stages and each stage into ``split`` sub-stages.

    Stages are balanced by ``layer_costs`` unless ``stage_sizes`` (layers per stage) is given;
    sub-stages are balanced by the same costs unless ``sub_sizes`` (per stage, layers per
    sub-stage) is given. With ``n_ranks``, each stage's sub-stage cut may be mirrored (e.g. 3
    layers as 1+2 instead of 2+1) so that the backward work per rank under
    :func:`sysx_assignment` stays even: SysX gives a fixed ``k`` to a fixed subset of ranks, so
    always putting the heavier half first would load those ranks more.
    """
    costs = tuple(float(c) for c in layer_costs)
    n = len(costs)
    if n == 0:
        raise PartitionError("the model has no layers: layer_costs is empty")
    if any(not np.isfinite(c) or c < 0 for c in costs):
        raise PartitionError(f"layer costs must be finite and >= 0, got {list(costs)}")
    if not isinstance(n_stages, int) or n_stages < 1:
        raise PartitionError(f"n_stages={n_stages!r} must be a positive int")
    if not isinstance(split, int) or split < 1:
        raise PartitionError(f"split d={split!r} must be a positive int")
    if n_stages > n:
        raise PartitionError(
            f"{n_stages} forward stages need at least {n_stages} layers but the model has {n}; "
            f"use at most {n} stages (or a deeper model)"
        )
    if stage_sizes is None:
        sizes = _balanced_cut(costs, n_stages)
    else:
        if len(stage_sizes) != n_stages:
            raise PartitionError(
                f"stage_sizes has {len(stage_sizes)} entries but n_stages={n_stages}; give one layer count per stage"
            )
        sizes = _check_sizes(
            stage_sizes, n, "stage_sizes", f"give {n_stages} layer counts that add up to the {n} layers"
        )
    bounds = [0]
    for x in sizes:
        bounds.append(bounds[-1] + x)
    subs: list[tuple[int, ...]] = []
    rank_load = [0.0] * (n_ranks or 0)
    for s in range(n_stages):
        lo, hi = bounds[s], bounds[s + 1]
        if sub_sizes is not None:
            if len(sub_sizes) != n_stages:
                raise PartitionError(f"sub_sizes has {len(sub_sizes)} entries but n_stages={n_stages}")
            if len(sub_sizes[s]) != split:
                raise PartitionError(
                    f"sub_sizes[{s}]={list(sub_sizes[s])} has {len(sub_sizes[s])} entries but split d={split}"
                )
            ss = _check_sizes(sub_sizes[s], hi - lo, f"sub_sizes[{s}]", f"stage {s} has {hi - lo} layers")
        else:
            if hi - lo < split:
                raise PartitionError(
                    f"stage {s} has {hi - lo} layer(s) ({lo}..{hi - 1}) but split d={split} needs at least "
                    f"{split} layers per stage; lower d to {hi - lo} or use fewer forward stages"
                )
            ss = _balanced_cut(costs[lo:hi], split)
            if n_ranks:
                ss = _orient_for_ranks(ss, costs, lo, s, n_stages, split, n_ranks, rank_load)
        sb = [lo]
        for x in ss:
            sb.append(sb[-1] + x)
        subs.append(tuple(sb))
    return Partition(costs, tuple(bounds), tuple(subs))


def _orient_for_ranks(
    sizes: list[int],
    costs: Sequence[float],
    lo: int,
    s: int,
    n_stages: int,
    split: int,
    n_ranks: int,
    rank_load: list[float],
) -> list[int]:
    """``sizes`` or its mirror image, whichever keeps the largest per-rank backward load smaller
    (``rank_load`` is updated with the choice)."""
    options = []
    for cand in (sizes, sizes[::-1]):
        load = list(rank_load)
        start = lo
        for k, n in enumerate(cand):
            q = (n_stages - 1 - s) * split + (split - 1 - k)
            load[sysx_bwd_rank(q, n_stages, n_ranks)] += sum(costs[start : start + n])
            start += n
        options.append((max(load), cand, load))
    best = options[1] if options[1][0] < options[0][0] - 1e-12 else options[0]
    rank_load[:] = best[2]
    return best[1]


def uniform_partition(n_stages: int, split: int = 1, layers_per_sub: int = 1) -> Partition:
    """A synthetic model of ``n_stages * split * layers_per_sub`` equal layers (unit-cost studies)."""
    n = n_stages * split * layers_per_sub
    return partition_layers([1.0] * n, n_stages, split=split)


def partition_model(
    cfg: Any,
    seq_len: int,
    n_stages: int,
    *,
    split: int = 1,
    stage_sizes: Sequence[int] | None = None,
    sub_sizes: Sequence[Sequence[int]] | None = None,
    n_ranks: int | None = None,
) -> Partition:
    """:func:`partition_layers` with the forward FLOPs of a :class:`sysx.model.ModelConfig`.

    The Embedding costs no FLOPs; it is given a tiny cost so that it is never an empty weight
    and stays with the first Block of stage 0.
    """
    from sysx.model import layer_flops  # the model contract; imported lazily

    costs = list(layer_flops(cfg, seq_len))
    costs[0] = max(costs[0], 1e-6 * max(costs))
    return partition_layers(costs, n_stages, split=split, stage_sizes=stage_sizes, sub_sizes=sub_sizes, n_ranks=n_ranks)


@dataclass(frozen=True)
class RankAssignment:
    """Which rank runs each forward stage and each backward sub-stage.

    ``fwd_rank[s]``: rank of forward stage ``s``. ``bwd_rank[s][k]``: rank of backward sub-stage
    ``(s, k)`` (it owns that sub-stage's gradients and optimizer state). ``bwd_order``: backward
    sub-stages in pipeline execution order (``q = 0 ..``).
    """

    n_ranks: int
    fwd_rank: tuple[int, ...]
    bwd_rank: tuple[tuple[int, ...], ...]
    bwd_order: tuple[tuple[int, int], ...]

    def fwd_stages(self, rank: int) -> list[int]:
        """Forward stages of ``rank``, ascending."""
        return [s for s, r in enumerate(self.fwd_rank) if r == rank]

    def describe(self) -> list[str]:
        """Two lines: the forward stages and the backward sub-stages (their owners) of every rank."""
        ranks = range(self.n_ranks)
        fwd = " | ".join(f"r{r}: " + ",".join(map(unit_label, self.fwd_stages(r))) for r in ranks)
        bwd = " | ".join(f"r{r}: " + ",".join(unit_label(s, k) for s, k in self.bwd_substages(r)) for r in ranks)
        return [f"forward stages   {fwd}", f"backward (owner) {bwd}"]

    def bwd_substages(self, rank: int) -> list[tuple[int, int]]:
        """Backward sub-stages of ``rank`` in execution order."""
        return [(s, k) for (s, k) in self.bwd_order if self.bwd_rank[s][k] == rank]

    @property
    def coupled(self) -> bool:
        """True when every backward sub-stage runs on the rank of its forward stage."""
        return all(r == self.fwd_rank[s] for s, row in enumerate(self.bwd_rank) for r in row)


def _check_ranks(n_stages: int, n_ranks: int, split: int) -> None:
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise PartitionError(f"n_ranks Ng={n_ranks!r} must be a positive int")
    if n_stages < n_ranks:
        raise PartitionError(
            f"{n_stages} forward stages cannot keep {n_ranks} ranks busy: every rank needs at least one "
            f"forward stage; use at least {n_ranks} stages (Nsf >= Ng) or fewer ranks"
        )


def coupled_assignment(n_stages: int, n_ranks: int) -> RankAssignment:
    """Forward and backward of stage ``s`` on rank ``s % n_ranks`` (whole stages, ``d = 1``)."""
    _check_ranks(n_stages, n_ranks, 1)
    fwd = tuple(s % n_ranks for s in range(n_stages))
    return RankAssignment(n_ranks, fwd, tuple((r,) for r in fwd), tuple((s, 0) for s in reversed(range(n_stages))))


def sysx_bwd_rank(q: int, n_stages: int, n_ranks: int) -> int:
    """The rank of SysX's ``q``-th backward sub-stage: ``(Nsf + q) % Ng``. Forward stage ``s`` runs
    on rank ``s % Ng``, and the backward goes on around the same ring: its first sub-stage runs on
    the rank after the last forward stage's.

    With ``Nsf`` a multiple of ``Ng`` (the paper's layouts) this is ``q % Ng``: rank 0 starts the
    backward (Fig. 8). Otherwise, e.g. one block per forward stage (``Nsf = L + 1``), the ring does
    not restart at rank 0: the rank that takes the first, heaviest sub-stage (the Head's) also takes
    the last one, which no drain follows, instead of starting the drain of the last round with it.
    """
    return (n_stages + q) % n_ranks


def sysx_assignment(n_stages: int, split: int, n_ranks: int) -> RankAssignment:
    """SysX's decoupled assignment (paper Fig. 8, DESIGN.md; the backward ring: :func:`sysx_bwd_rank`)."""
    _check_ranks(n_stages, n_ranks, split)
    if not isinstance(split, int) or split < 1:
        raise PartitionError(f"split d={split!r} must be a positive int")
    fwd = tuple(s % n_ranks for s in range(n_stages))
    bwd = [[0] * split for _ in range(n_stages)]
    order = []
    for q in range(n_stages * split):
        s, k = n_stages - 1 - q // split, split - 1 - q % split
        bwd[s][k] = sysx_bwd_rank(q, n_stages, n_ranks)
        order.append((s, k))
    return RankAssignment(n_ranks, fwd, tuple(tuple(row) for row in bwd), tuple(order))
