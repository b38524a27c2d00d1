"""Where each unit's Adam update runs: the CPU lane or the device lane (Deep Optimizer States).

A *unit* is a backward sub-stage a rank owns (the pipeline) or a group of the sliding window
(:mod:`sysx.single.lanes`). :func:`place` puts on the device lane the units that make the optimizer
stop holding the next passes soonest (:attr:`Placement.finish`), under a model of both lanes'
copies and steps; :func:`choose` applies ``optim.placement`` (``cpu``, ``split``, ``auto``).
Pure data and arithmetic: no torch, so the model is unit-tested alone and printed by the runtime.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sysx.config.choices import PLACEMENTS

IN_BYTES = 16  # per parameter copied in: fp32 gradient, master weight, m, v
OUT_BYTES = 12  # per parameter copied out: master weight, m, v
# device memory traffic of one fused AdamW step: read g, p, m, v and write p, m, v (fp32)
STEP_BYTES = 28
NOT_EARLIER = "the device lane would not end the optimizer work earlier"  # why nothing is on it, most often
LANE_BYTES = 20  # device memory of a unit on the lane: g, p, m, v and a scratch buffer (fp32)


@dataclass(frozen=True)
class LaneRates:
    """The figures the model reads (bytes/s, parameters/s): the machine profile's or the emulated
    cluster's. ``device_mem_bytes_per_s`` bounds the device step (an elementwise, memory-bound op)."""

    cpu_params_per_s: float  # one CPU Adam worker
    cpu_workers: int
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    device_mem_bytes_per_s: float
    device_free_bytes: float = float("inf")  # device memory the lane may use (a unit needs LANE_BYTES per parameter)
    # the lane's copies overlap each other and the steps (the emulated lane's engines); False: one
    # unit after another, as the CUDA lane copies pageable masters and moments, synchronously
    overlapped: bool = True

    def __post_init__(self) -> None:
        for name in ("cpu_params_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s", "device_mem_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LaneRates: {name}={getattr(self, name)} must be > 0")
        if self.cpu_workers < 1:
            raise ValueError(f"LaneRates: cpu_workers={self.cpu_workers} must be >= 1")


@dataclass(frozen=True)
class Unit:
    """One unit's optimizer work: ``numel`` parameters whose gradients are home at ``ready`` (s),
    needed ``due`` seconds after the next passes start (on the CPU lane; see docs/architecture.md)."""

    name: str
    numel: int
    ready: float
    due: float = 0.0


@dataclass(frozen=True)
class Placement:
    """The chosen split and the model's times (seconds from the start of the step)."""

    device: tuple[str, ...]  # units stepped on the device lane
    cpu_finish: float  # when the optimizer stops holding the next passes with every unit on the CPU
    finish: float  # ... with this split
    ends: dict[str, float] = field(default_factory=dict)  # each unit's end with this split
    device_times: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # device units' (in, step, out)
    why: str = ""  # nothing on the device for a reason other than time (said by describe)

    @property
    def saving(self) -> float:
        """Predicted seconds saved per step against the CPU lane alone."""
        return self.cpu_finish - self.finish

    def describe(self, units: Sequence[Unit], noun: str = "unit") -> str:
        """``optimizer placement: 2 of 4 sub-stages on the device (s1.0, s1.1; 12.6M of 25.2M
        parameters): optimizer work ends 1.20 s into the step instead of 2.05 s, predicted saving
        0.85 s per step``; with nothing on the device, that and why in one short line."""
        numel = {u.name: u.numel for u in units}
        total = sum(numel.values())
        ends = "is done as the next forward needs it" if any(u.due > 0 for u in units) else "ends"
        if not self.device:
            why = self.why or NOT_EARLIER
            return (
                f"optimizer placement: all {_plural(len(units), noun)} on the CPU ({count(total)} parameters): "
                f"{why} (optimizer work {ends} {seconds(self.cpu_finish)} into the step)"
            )
        on = sum(numel[n] for n in self.device)
        shown = (
            self.device
            if len(self.device) <= 6
            else (*self.device[:3], f"... {len(self.device) - 5} more", *self.device[-2:])
        )  # a window of 80 blocks
        return (
            f"optimizer placement: {len(self.device)} of {_plural(len(units), noun)} on the device "
            f"({', '.join(shown)}; {count(on)} of {count(total)} parameters): optimizer work {ends} "
            f"{seconds(self.finish)} into the step instead of {seconds(self.cpu_finish)}, predicted saving "
            f"{seconds(self.saving)} per step"
        )


def count(n: float) -> str:
    """A parameter count for people: ``2.16B``, ``12.6M``, ``850K``, ``96``."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


def seconds(t: float) -> str:
    """A duration for people: ``2.07 s``; under 0.1 s in ms (``3.2 ms``: a small job's step)."""
    return f"{t:.2f} s" if abs(t) >= 0.1 or t == 0 else f"{t * 1e3:.1f} ms"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def cpu_seconds(numel: int, rates: LaneRates) -> float:
    """One unit's step on one CPU worker."""
    return numel / rates.cpu_params_per_s


def device_seconds(numel: int, rates: LaneRates) -> tuple[float, float, float]:
    """One unit on the device lane: ``(copy in, step, copy out)`` seconds."""
    return (
        numel * IN_BYTES / rates.h2d_bytes_per_s,
        numel * STEP_BYTES / rates.device_mem_bytes_per_s,
        numel * OUT_BYTES / rates.d2h_bytes_per_s,
    )


def finish_times(
    units: Sequence[Unit], on_device: Iterable[str], rates: LaneRates, *, device_idle: float, speculative: bool = True
) -> dict[str, float]:
    """When each unit's update ends with the units named in ``on_device`` on the device lane."""
    on_device = set(on_device)
    last_ready = max((u.ready for u in units), default=0.0)
    ends: dict[str, float] = {}
    workers = [0.0] * rates.cpu_workers  # a heap of the workers' free times
    # validating first, the CPU lane takes the units in the order they are due (the window's next
    # forward; all at once in the pipeline), then as they came home
    order = (lambda u: u.ready) if speculative else (lambda u: (u.due, u.ready))
    for u in sorted((u for u in units if u.name not in on_device), key=order):
        start = max(u.ready if speculative else last_ready, heapq.heappop(workers))
        ends[u.name] = start + cpu_seconds(u.numel, rates)
        heapq.heappush(workers, ends[u.name])
    decided = max([last_ready, *ends.values()]) if speculative else last_ready
    lane = sorted((u for u in units if u.name in on_device), key=lambda u: u.ready)
    ends.update(
        zip(
            (u.name for u in lane),
            device_flow(
                max(decided, device_idle), [device_seconds(u.numel, rates) for u in lane], overlapped=rates.overlapped
            ),
        )
    )
    return ends


def device_flow(start: float, times: Sequence[tuple[float, float, float]], *, overlapped: bool = True) -> list[float]:
    """When each unit of the device lane is copied out, the lane starting at ``start``: copies in on
    the H2D engine back to back, each step on the compute engine after its copy in, each copy out on
    the D2H engine after its step (``times``: the units' (in, step, out) seconds, in lane order);
    not ``overlapped``: each unit's copy in, step and copy out after the previous unit's."""
    h2d = step = d2h = start
    out = []
    if not overlapped:
        for t_in, t_step, t_out in times:
            d2h += t_in + t_step + t_out
            out.append(d2h)
        return out
    for t_in, t_step, t_out in times:
        h2d += t_in
        step = max(h2d, step) + t_step
        d2h = max(step, d2h) + t_out
        out.append(d2h)
    return out


def holds_until(units: Sequence[Unit], ends: dict[str, float], on_device: Iterable[str]) -> float:
    """When the optimizer stops holding the next passes (docs/architecture.md's figure of merit)."""
    on_device = set(on_device)
    late = [ends[u.name] if u.name in on_device else ends[u.name] - u.due for u in units]
    return max([max((u.ready for u in units), default=0.0), *late])


def place(units: Sequence[Unit], rates: LaneRates, *, device_idle: float, speculative: bool = True) -> Placement:
    """The split that ends the optimizer work soonest by the greedy rule in docs/architecture.md.

    ``device_idle``: when the device has no more passes this step; ``speculative``: whether the
    CPU lane steps before the validation (``optim.speculate``).
    """
    if not units:
        return Placement((), 0.0, 0.0, {})
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise ValueError(f"place: unit names must be unique, got {names}")

    def finish(on: Iterable[str]) -> tuple[float, dict[str, float]]:
        on = list(on)
        ends = finish_times(units, on, rates, device_idle=device_idle, speculative=speculative)
        return holds_until(units, ends, on), ends

    cpu_finish, ends = finish(())
    # the k units ready last, for every k (one move alone may gain nothing while two do: the CPU
    # lane ends when its last worker does), then single moves while one helps
    by_ready = [u.name for u in sorted(units, key=lambda u: u.ready) if u.numel * LANE_BYTES <= rates.device_free_bytes]
    names = [n for n in names if n in by_ready]  # a unit whose states do not fit on the device stays on the CPU
    best, k = min((finish(by_ready[len(by_ready) - k :])[0], k) for k in range(len(by_ready) + 1))
    chosen = by_ready[len(by_ready) - k :]
    while len(chosen) < len(names):
        t, n = min((finish([*chosen, n])[0], n) for n in names if n not in chosen)
        if t >= best:
            break
        chosen.append(n)
        best = t
    best, ends = finish(chosen)
    order = {n: i for i, n in enumerate(names)}
    numel = {u.name: u.numel for u in units}
    why = "" if by_ready else "no unit's states fit in the device memory left free"
    return Placement(
        tuple(sorted(chosen, key=order.__getitem__)),
        cpu_finish,
        best,
        ends,
        {n: device_seconds(numel[n], rates) for n in chosen},
        why,
    )


def choose(
    mode: str,
    units: Sequence[Unit],
    rates: LaneRates,
    *,
    device_idle: float,
    speculative: bool = True,
    separate_device: bool = True,
) -> Placement:
    """``optim.placement``: ``cpu`` (every unit on the CPU), ``split`` (the model's split), ``auto``
    (the model's split where the device is a separate processor, ``separate_device``; on a CPU-only
    job the "device" is the host itself, so nothing is gained and auto keeps the CPU lane)."""
    if mode not in PLACEMENTS:
        raise ValueError(f"optim.placement={mode!r} is not valid; allowed: {', '.join(PLACEMENTS)}")
    model = place(units, rates, device_idle=device_idle, speculative=speculative)
    if mode == "cpu" or (mode == "auto" and not separate_device):
        ends = finish_times(units, (), rates, device_idle=device_idle, speculative=speculative)
        return Placement((), model.cpu_finish, model.cpu_finish, ends)
    return model


def record(placed: Placement, units: Sequence[Unit]) -> dict[str, object]:
    """One rank's split, JSON-ready (``summary.json``'s ``placement``; the benchmark's rows)."""
    numel = {u.name: u.numel for u in units}
    return {
        "device": list(placed.device),
        "units": len(units),
        "device_params": sum(numel[n] for n in placed.device),
        "params": sum(numel.values()),
        "cpu_finish_s": placed.cpu_finish,
        "finish_s": placed.finish,
        "saving_s": placed.saving,
        **({"why": placed.why} if placed.why else {}),
    }


def summarize(ranks: Sequence[tuple[Placement, Sequence[Unit]]], noun: str = "unit") -> str:
    """One line for every rank's split (rank 0 prints it): one rank's :meth:`Placement.describe`,
    else the totals, each rank's count on the device and the ranges of the predicted times."""
    if len(ranks) == 1:
        return ranks[0][0].describe(ranks[0][1], noun)
    numel = [{u.name: u.numel for u in us} for _, us in ranks]
    n_on, n_all = sum(len(p.device) for p, _ in ranks), sum(len(us) for _, us in ranks)
    p_on = sum(sum(n[name] for name in p.device) for (p, _), n in zip(ranks, numel))
    p_all = sum(sum(n.values()) for n in numel)
    ends = "is done as the next forward needs it" if any(x.due > 0 for _, us in ranks for x in us) else "ends"
    head = f"optimizer placement over {len(ranks)} ranks:"
    cpu = _range([p.cpu_finish for p, _ in ranks])
    if not n_on:
        whys = {p.why for p, _ in ranks}
        why = whys.pop() if whys != {""} and len(whys) == 1 else f"{NOT_EARLIER} on any rank"
        return (
            f"{head} all {_plural(n_all, noun)} on the CPU ({count(p_all)} parameters): {why} "
            f"(optimizer work {ends} {cpu} into the step)"
        )
    per = [f"{len(p.device)}/{len(us)}" for p, us in ranks]
    each = f"{per[0]} on each rank" if len(set(per)) == 1 else "per rank " + ", ".join(per)
    return (
        f"{head} {n_on} of {_plural(n_all, noun)} on the device ({each}; {count(p_on)} of {count(p_all)} "
        f"parameters): optimizer work {ends} {_range([p.finish for p, _ in ranks])} into the step instead of "
        f"{cpu}, predicted saving {_range([p.saving for p, _ in ranks])} per step"
    )


def _range(values: Sequence[float]) -> str:
    """``1.25-1.34 s`` over the ranks (one figure when they agree to the shown digits)."""
    lo, hi = seconds(min(values)), seconds(max(values))
    return lo if lo == hi else f"{lo.split()[0]}-{hi}" if lo.split()[1] == hi.split()[1] else f"{lo}-{hi}"
