"""Profiled costs: a :class:`~sysx.schedule.costs.CostTable` read off a measured window, so that
:func:`~sysx.schedule.simulate.simulate` fed with it predicts the same schedule (the plan printed
beside a measurement, and the autotuner's cost model).

Every duration is the median over the window (all ranks, steps and micro-batches) of one
(op kind, stage, sub-stage); a FORWARD or BACKWARD without a sample is an error.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from statistics import median

from sysx.schedule.costs import CostTable
from sysx.schedule.ops import RECVS, SENDS, Message, OpKind, Schedule
from sysx.trace.recorder import COMPUTE, D2H, H2D, OPT, P2P, Span, lane_family


def _medians(samples: dict[int, list[float]], n: int) -> list[float]:
    return [float(median(samples[i])) if samples.get(i) else 0.0 for i in range(n)]


def _transfers(spans: Sequence[Span], d: int) -> dict[Message, dict[int, list[float]]]:
    """Transfer seconds per message kind and cost index (stage for act, ``s*d+k`` otherwise)."""
    sides: dict[tuple, dict[str, Span]] = defaultdict(dict)
    for s in spans:
        if lane_family(s.lane) != P2P or s.op is None:
            continue
        if s.op.kind in SENDS:
            sides[(s.step, s.op.message, s.rank, s.op.peer)]["send"] = s
        elif s.op.kind in RECVS:
            sides[(s.step, s.op.message, s.op.peer, s.rank)]["recv"] = s
    out: dict[Message, dict[int, list[float]]] = {m: defaultdict(list) for m in Message}
    for (_, (kind, stage, sub, _), _, _), pair in sides.items():
        start = max(p.start for p in pair.values())
        end = min(p.end for p in pair.values())
        out[kind][stage if kind == Message.ACT else stage * d + sub].append(max(0.0, end - start))
    return out


def _allreduce(spans: Sequence[Span]) -> float:
    """Median over steps of the shortest (over ranks) VALIDATE time after the rank's last step job."""
    last_opt: dict[tuple[int, int], float] = {}
    for s in spans:
        if lane_family(s.lane) == OPT and s.op is not None and s.op.is_async:
            key = (s.step, s.rank)
            last_opt[key] = max(last_opt.get(key, s.end), s.end)
    per_step: dict[int, list[float]] = defaultdict(list)
    for s in spans:
        if s.lane == COMPUTE and s.op is not None and s.op.kind == OpKind.VALIDATE:
            ready = min(max(s.start, last_opt.get((s.step, s.rank), s.start)), s.end)
            per_step[s.step].append(s.end - ready)
    return float(median(min(v) for v in per_step.values())) if per_step else 0.0


def measured_costs(
    spans: Sequence[Span], schedule: Schedule, *, param_bytes: float = 2.0, rendezvous: bool = True
) -> CostTable:
    """The :class:`CostTable` of ``schedule`` profiled from ``spans`` (see docs/architecture.md);
    ``param_bytes``: bytes per parameter of the copies (the model's dtype)."""
    p = schedule.partition
    nsf, d = p.n_stages, p.split
    nsub = nsf * d
    times: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    sizes: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    workers: dict[int, set[str]] = defaultdict(set)
    for s in spans:
        op, family = s.op, lane_family(s.lane)
        if family == OPT:
            workers[s.rank].add(s.lane)
        if op is None or (family == OPT and not op.is_async):  # a validation job: no step of the list
            continue
        g = op.stage * d + op.sub
        if family == P2P and op.kind == OpKind.SEND_CKPT and s.nbytes:
            sizes["ckpt"][g].append(float(s.nbytes))
        key = {
            (COMPUTE, OpKind.FORWARD): "fwd",
            (COMPUTE, OpKind.BACKWARD): "bwd",
            (D2H, OpKind.OFFLOAD_GRADS): "offload",
            (COMPUTE, OpKind.OPTIM_STEP): "opt",
            (OPT, OpKind.OPTIM_STEP): "opt",
            (H2D, OpKind.LOAD_PARAMS): "load_stage" if op.sub < 0 else "load_sub",
        }.get((family, op.kind))
        if key is None:
            continue
        index = op.stage if key in ("fwd", "load_stage") else g
        times[key][index].append(s.end - s.start)
        if s.nbytes:
            sizes[key][index].append(float(s.nbytes))
    missing = [f"F s{i}" for i in range(nsf) if not times["fwd"].get(i)]
    missing += [f"B s{g // d}.{g % d}" for g in range(nsub) if not times["bwd"].get(g)]
    if missing:
        raise ValueError(f"measured_costs: no recorded span of {', '.join(missing[:6])}; record whole training steps")
    xfer = _transfers(spans, d)
    param_sub = _medians(sizes["load_sub"], nsub)
    grad_mem = _medians(sizes["offload"], nsub)
    params_sub = [(a or b) / param_bytes for a, b in zip(param_sub, grad_mem)]
    param_stage = _medians(sizes["load_stage"], nsf)
    params_stage = [(param_stage[s] / param_bytes) or sum(params_sub[s * d : (s + 1) * d]) for s in range(nsf)]
    return CostTable(
        split=d,
        fwd=_medians(times["fwd"], nsf),
        bwd=_medians(times["bwd"], nsub),
        opt=_medians(times["opt"], nsub),
        load_stage=_medians(times["load_stage"], nsf),
        load_sub=_medians(times["load_sub"], nsub),
        offload=_medians(times["offload"], nsub),
        act_xfer=_medians(xfer[Message.ACT], nsf),
        grad_xfer=_medians(xfer[Message.GRAD], nsub),
        ckpt_xfer=_medians(xfer[Message.CKPT], nsub),
        allreduce=_allreduce(spans),
        param_stage=param_stage,
        param_sub=param_sub,
        grad_mem=grad_mem,
        ckpt_mem=_medians(sizes["ckpt"], nsub),
        fwd_work=[0.0] * nsf,
        bwd_work=[0.0] * nsub,
        param_bytes=param_bytes,
        params_stage=params_stage,
        params_sub=params_sub,
        rendezvous=rendezvous,
        optim_workers=max((len(v) for v in workers.values()), default=None),
        unit="s",
    )
