"""Which activations each layer saves: the AdaWS dynamic program and the PyAO throughput rule.

A save *level* (0 ``input`` ... 4 ``everything``) is the set of op outputs a layer keeps from its
forward pass; the rest is recomputed from the layer input during backward. :func:`solve_save_levels`
picks one level per layer to maximise the recompute time avoided within the activation ring's copy
constraint (and an optional host-memory cap); :func:`pyao_recompute_mask` is PyAO's rule (§4.4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sysx.config.choices import SAVE_LEVELS as LEVEL_NAMES

# Site categories in the order the levels add them.
CATEGORIES: tuple[str, ...] = ("attention", "narrow_matmul", "wide_matmul", "elementwise")
N_LEVELS = len(LEVEL_NAMES)
_EPS = 1e-12


def level_categories(level: int) -> frozenset[str]:
    """The site categories saved at ``level`` (0 = none: only the layer input)."""
    if not 0 <= level < N_LEVELS:
        raise ValueError(f"save level {level} out of range: levels are 0..{N_LEVELS - 1} ({', '.join(LEVEL_NAMES)})")
    return frozenset(CATEGORIES[:level])


def parse_level(value: int | str) -> int:
    """A level given as its id or its name (``"matmuls"`` -> 3)."""
    if isinstance(value, str):
        text = value.strip()
        if text in LEVEL_NAMES:
            return LEVEL_NAMES.index(text)
        if not text.isdigit():
            raise ValueError(f"unknown save level {value!r}; use 0..{N_LEVELS - 1} or one of {', '.join(LEVEL_NAMES)}")
        value = int(text)
    if not 0 <= int(value) < N_LEVELS:
        raise ValueError(f"save level {value} out of range: levels are 0..{N_LEVELS - 1} ({', '.join(LEVEL_NAMES)})")
    return int(value)


# ------------------------------------------------------------------------------------- the problem


@dataclass(frozen=True)
class SaveProblem:
    """Inputs of the saved-activation DP for one forward pass over ``L`` layers.

    ``compute_s[i]``: forward compute time of layer ``i`` for the whole round (all chunks).
    ``transfer_s[i][o]``: outbound copy time of one chunk of layer ``i`` at option ``o``.
    ``value_s[i][o]``: recompute time avoided (whole round) when layer ``i`` saves option ``o``.
    ``ring_slots``: activation ring capacity ``R_act`` in (layer, chunk) units.
    ``chunks``: chunks per round; unit ``u = i * chunks + c`` computes in order.
    ``transfer_layers``: layers ``0..transfer_layers-1`` copy their activations home; the later ones
    (the last window) keep them on the device and take no part in the choice.
    ``host_bytes[i][o]`` / ``host_capacity``: optional bound on the bytes kept in host memory.
    """

    compute_s: tuple[float, ...]
    transfer_s: tuple[tuple[float, ...], ...]
    value_s: tuple[tuple[float, ...], ...]
    ring_slots: int
    chunks: int = 1
    transfer_layers: int | None = None
    host_bytes: tuple[tuple[float, ...], ...] | None = None
    host_capacity: float | None = None

    @classmethod
    def make(
        cls,
        compute_s: Sequence[float],
        transfer_s: Sequence[Sequence[float]],
        value_s: Sequence[Sequence[float]],
        *,
        ring_slots: int,
        chunks: int = 1,
        transfer_layers: int | None = None,
        host_bytes: Sequence[Sequence[float]] | None = None,
        host_capacity: float | None = None,
    ) -> SaveProblem:
        """Build and check a problem from plain sequences."""
        p = cls(
            tuple(float(c) for c in compute_s),
            tuple(tuple(float(t) for t in row) for row in transfer_s),
            tuple(tuple(float(v) for v in row) for row in value_s),
            int(ring_slots),
            int(chunks),
            transfer_layers,
            None if host_bytes is None else tuple(tuple(float(b) for b in row) for row in host_bytes),
            None if host_capacity is None else float(host_capacity),
        )
        p.check()
        return p

    @property
    def n_layers(self) -> int:
        """Layers in the forward pass."""
        return len(self.compute_s)

    @property
    def n_transfer(self) -> int:
        """Layers whose activations go home (the first ``L - W``)."""
        return self.n_layers if self.transfer_layers is None else self.transfer_layers

    def check(self) -> None:
        """Raise ValueError naming the first inconsistent input."""
        L = self.n_layers
        if len(self.transfer_s) < self.n_transfer or len(self.value_s) < self.n_transfer:
            raise ValueError(
                f"SaveProblem: need transfer/value rows for {self.n_transfer} layers, got "
                f"{len(self.transfer_s)} / {len(self.value_s)}"
            )
        if not 0 <= self.n_transfer <= L:
            raise ValueError(f"SaveProblem: transfer_layers={self.transfer_layers} must be in [0, {L}]")
        if self.ring_slots < 1 or self.chunks < 1:
            raise ValueError(f"SaveProblem: ring_slots={self.ring_slots} and chunks={self.chunks} must be >= 1")
        for i in range(self.n_transfer):
            if len(self.transfer_s[i]) != len(self.value_s[i]) or not self.transfer_s[i]:
                raise ValueError(
                    f"SaveProblem: layer {i} has {len(self.transfer_s[i])} transfer options and "
                    f"{len(self.value_s[i])} values; give the same (>= 1) number"
                )
            if self.host_bytes is not None and len(self.host_bytes[i]) != len(self.transfer_s[i]):
                raise ValueError(
                    f"SaveProblem: layer {i} host_bytes has {len(self.host_bytes[i])} options, "
                    f"expected {len(self.transfer_s[i])}"
                )
        if any(c < 0 for c in self.compute_s):
            raise ValueError("SaveProblem: compute times must be >= 0")

    # -- timeline
    def unit_start(self) -> list[float]:
        """Start time of every (layer, chunk) unit when nothing stalls, plus the end of the pass."""
        starts, t = [], 0.0
        for c in self.compute_s:
            for _ in range(self.chunks):
                starts.append(t)
                t += c / self.chunks
        starts.append(t)
        return starts

    def deadline(self, unit: int, starts: Sequence[float]) -> float:
        """When the ring slot of ``unit`` must be drained: the start of unit ``unit + R_act``."""
        return starts[min(unit + self.ring_slots, len(starts) - 1)]


@dataclass(frozen=True)
class SaveSolution:
    """Result of :func:`solve_save_levels`.

    ``levels[i]`` is the option of each transferring layer; ``value`` the recompute time avoided;
    ``feasible`` False when even the smallest options cannot drain the ring in time (then
    ``levels`` are all 0 and ``stall_s`` is the forward stall they cause); ``exact`` False when the
    state front was thinned; ``finish_s`` the outbound finish time of every transferring layer.
    """

    levels: tuple[int, ...]
    value: float
    feasible: bool
    exact: bool
    stall_s: float
    finish_s: tuple[float, ...]
    host_bytes: float


def simulate_forward(problem: SaveProblem, levels: Sequence[int]) -> tuple[bool, float, list[float], float]:
    """Play the forward pass with ``levels`` on the transferring layers.

    Returns ``(no_stall, stall_s, finish_s per transferring layer, host_bytes)``. A unit whose ring
    slot is still being copied waits (a stall) until the copy ends; ``no_stall`` is True when no
    unit waits and the host capacity (if any) holds.
    """
    n = problem.chunks
    U = problem.n_layers * n
    drained = [0.0] * U  # when each unit's slot copy ends (its compute end if it copies nothing)
    t_compute = 0.0
    queue = 0.0
    stall = 0.0
    finish: list[float] = []
    for u in range(U):
        i = u // n
        begin = t_compute
        if u - problem.ring_slots >= 0:
            begin = max(begin, drained[u - problem.ring_slots])
        stall += begin - t_compute
        end = begin + problem.compute_s[i] / n
        t_compute = end
        if i < problem.n_transfer:
            queue = max(queue, end) + problem.transfer_s[i][levels[i]]
            drained[u] = queue
            if u % n == n - 1:
                finish.append(queue)
        else:
            drained[u] = end
    host = 0.0
    if problem.host_bytes is not None:
        host = sum(problem.host_bytes[i][levels[i]] * n for i in range(problem.n_transfer))
    # the last units' copies must end before the backward pass needs their slots (end of forward)
    tail_ok = all(drained[u] <= t_compute + _tol(t_compute) for u in range(U))
    ok = stall <= _tol(t_compute) and tail_ok
    if problem.host_capacity is not None and host > problem.host_capacity * (1 + 1e-12):
        ok = False
    return ok, stall, finish, host


def _tol(scale: float) -> float:
    return 1e-9 * max(1.0, abs(scale))


def solve_save_levels(problem: SaveProblem, *, max_states: int = 20000) -> SaveSolution:
    """Maximise the recompute time avoided subject to the ring-capacity (and host) constraints.

    Dynamic program over the transferring layers in order. A state is the outbound stream's
    finish time ``F`` after the layer, the host bytes used ``H`` and the value ``V``; a state is
    dropped when another has ``F' <= F``, ``H' <= H`` and ``V' >= V``, which keeps the DP exact.
    Choosing option ``o`` for layer ``i`` plays its chunks: each copy starts when both the stream
    and the chunk's compute are done, and must end before the unit ``R_act`` places later starts.
    """
    problem.check()
    n = problem.chunks
    starts = problem.unit_start()
    end_of_pass = starts[-1]
    tol = _tol(end_of_pass)
    cap = problem.host_capacity
    # state: (F, H, V, parent index, option)
    front: list[tuple[float, float, float, int, int]] = [(0.0, 0.0, 0.0, -1, -1)]
    history: list[list[tuple[float, float, float, int, int]]] = []
    exact = True
    for i in range(problem.n_transfer):
        c_unit = problem.compute_s[i] / n
        candidates: list[tuple[float, float, float, int, int]] = []
        for si, (F, H, V, _, _) in enumerate(front):
            for o, t in enumerate(problem.transfer_s[i]):
                q = F
                ok = True
                for c in range(n):
                    u = i * n + c
                    q = max(q, starts[u] + c_unit) + t
                    if q > problem.deadline(u, starts) + tol:
                        ok = False
                        break
                if not ok:
                    continue
                h = H + (problem.host_bytes[i][o] * n if problem.host_bytes is not None else 0.0)
                if cap is not None and h > cap * (1 + 1e-12):
                    continue
                candidates.append((q, h, V + problem.value_s[i][o], si, o))
        if not candidates:
            return _infeasible(problem)
        front = _pareto(candidates)
        if len(front) > max_states:
            exact = False
            step = len(front) / max_states
            front = [front[int(k * step)] for k in range(max_states)]
        history.append(front)
    if not history:
        return SaveSolution((), 0.0, True, True, 0.0, (), 0.0)
    best = max(range(len(front)), key=lambda k: (front[k][2], -front[k][0], -front[k][1]))
    levels = [0] * problem.n_transfer
    k = best
    for i in range(problem.n_transfer - 1, -1, -1):
        _, _, _, parent, option = history[i][k]
        levels[i] = option
        k = parent
    ok, stall, finish, host = simulate_forward(problem, levels)
    return SaveSolution(tuple(levels), front[best][2], ok, exact, stall, tuple(finish), host)


def _pareto(cands: list[tuple[float, float, float, int, int]]) -> list[tuple[float, float, float, int, int]]:
    """Non-dominated states (small F, small H, large V), sorted by F."""
    cands.sort(key=lambda s: (s[0], s[1], -s[2]))
    kept: list[tuple[float, float, float, int, int]] = []
    for s in cands:
        dominated = False
        for k in kept:  # every kept state has F <= s.F
            if k[1] <= s[1] and k[2] >= s[2]:
                dominated = True
                break
        if not dominated:
            kept.append(s)
    return kept


def _infeasible(problem: SaveProblem) -> SaveSolution:
    levels = [0] * problem.n_transfer
    _, stall, finish, host = simulate_forward(problem, levels)
    value = sum(problem.value_s[i][0] for i in range(problem.n_transfer))
    return SaveSolution(tuple(levels), value, False, True, stall, tuple(finish), host)


def brute_force_levels(problem: SaveProblem) -> tuple[tuple[int, ...] | None, float]:
    """Best feasible assignment by enumerating every combination (for tests; small problems only)."""
    import itertools

    best: tuple[int, ...] | None = None
    best_value = -math.inf
    options = [range(len(problem.transfer_s[i])) for i in range(problem.n_transfer)]
    for combo in itertools.product(*options):
        ok, _, _, _ = simulate_forward(problem, combo)
        if not ok:
            continue
        value = sum(problem.value_s[i][o] for i, o in enumerate(combo))
        if value > best_value + 1e-15:
            best, best_value = combo, value
    return best, best_value


# ------------------------------------------------------------------------------------------ PyAO


def iqr_upper_fence(values: Sequence[float], k: float = 1.5) -> float:
    """``Q3 + k * (Q3 - Q1)`` of ``values`` (linear-interpolated quartiles)."""
    if not len(values):
        raise ValueError("iqr_upper_fence: no values")
    q1, q3 = np.percentile(np.asarray(values, dtype=np.float64), [25.0, 75.0])
    return float(q3 + k * (q3 - q1))


def pyao_recompute_mask(throughputs: Sequence[float], link_bytes_per_s: float, k: float = 1.5) -> list[bool]:
    """PyAO §4.4: True for each site to recompute instead of offload.

    A site is recomputed when its activation throughput (bytes it saves per second of its compute)
    lies above the IQR upper fence of all sites *and* above the link bandwidth, i.e. it produces
    bytes faster than the link can carry them and much faster than its peers.
    """
    fence = iqr_upper_fence(throughputs, k)
    return [t > fence and t > link_bytes_per_s for t in throughputs]
