"""Turn per-rank compute orders (FORWARD/BACKWARD only) into complete op lists.

Every builder only decides, per rank, in which order its forward and backward passes run. This
module adds everything else, the same way for every schedule:

1. A logical timeline: the compute orders are executed with forward = ``d`` and backward
   sub-stage = ``2`` time units (a stage's backward is twice its forward) and free communication.
   An order that cannot run (a rank waits for a pass that comes later in its own list, or two
   ranks wait for each other) is an error naming the stuck passes.
2. Messages: an activation, input gradient or checkpoint crossing ranks gets a send/recv pair.
   Each message has one global key: the logical time its data becomes ready (activations and
   gradients: the end of the producing pass; async checkpoints: the end of the forward, on both
   ranks, as in the paper's checkpoint communication schedule; sync checkpoints: the start of
   the consuming backward), then a fixed tie-break. Both ranks place the message at that key,
   so every rank posts its sends and receives in one global order: no cycle of blocking
   sends/receives can form, and every pair of ranks posts its messages in the same order (NCCL
   matches point-to-point messages of a pair in posting order, without tags).
3. Parameter buffers: with ``param_buffers`` GPU buffers per rank, a unit (forward stage or
   backward sub-stage) is loaded as soon as a buffer is free, the buffer of a unit not needed
   any more is freed right after its last use, and when all buffers hold units needed later the
   one needed last is evicted first (Belady), so the next unit is prefetched while the current
   one computes.
4. Gradients: ``OFFLOAD_GRADS`` right after a sub-stage's last backward; the asynchronous
   optimizer posts its ``OPTIM_STEP`` right after; ``VALIDATE`` ends every list and the
   synchronous optimizer steps the rank's sub-stages after it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from sysx.partition import Partition, Placement
from sysx.schedule.ops import CkptRoute, Op, OpKind, Schedule, ScheduleError

_ACT, _GRAD, _CKPT, _WAIT = 0, 1, 2, 3
_SEND_OF = {_ACT: OpKind.SEND_ACT, _GRAD: OpKind.SEND_GRAD, _CKPT: OpKind.SEND_CKPT}
_RECV_OF = {_ACT: OpKind.RECV_ACT, _GRAD: OpKind.RECV_GRAD, _CKPT: OpKind.RECV_CKPT}


def next_sub(s: int, k: int, n_stages: int, split: int) -> tuple[int, int] | None:
    """The backward sub-stage whose input gradient ``(s, k)`` consumes (``None`` for the last)."""
    if k < split - 1:
        return (s, k + 1)
    if s < n_stages - 1:
        return (s + 1, 0)
    return None


def prev_sub(s: int, k: int, split: int) -> tuple[int, int] | None:
    """The backward sub-stage that consumes ``(s, k)``'s input gradient (``None`` for the first)."""
    if k > 0:
        return (s, k - 1)
    if s > 0:
        return (s - 1, split - 1)
    return None


def logical_times(orders: Sequence[Sequence[Op]], n_stages: int, split: int, n_micro: int
                  ) -> tuple[dict[Op, int], dict[Op, tuple[float, float]]]:
    """Rank of every pass, and its (start, end) on the logical timeline (see the module doc)."""
    where: dict[Op, int] = {}
    for r, order in enumerate(orders):
        for op in order:
            if op.kind not in (OpKind.FORWARD, OpKind.BACKWARD):
                raise ScheduleError(f"rank {r}: compute orders hold FORWARD/BACKWARD only, got `{op}`")
            if op in where:
                raise ScheduleError(f"`{op}` appears twice in the compute orders (ranks {where[op]} and {r})")
            where[op] = r
    missing = [f"F s{s} mb{j}" for s in range(n_stages) for j in range(n_micro)
               if Op(OpKind.FORWARD, s, -1, j) not in where]
    missing += [f"B s{s}.{k} mb{j}" for s in range(n_stages) for k in range(split) for j in range(n_micro)
                if Op(OpKind.BACKWARD, s, k, j) not in where]
    if missing:
        raise ScheduleError(f"the compute orders miss {len(missing)} pass(es): {', '.join(missing[:8])}")
    if len(where) != n_stages * n_micro * (1 + split):
        extra = [str(op) for op in where if not (0 <= op.stage < n_stages and 0 <= op.mb < n_micro
                                                   and (op.kind == OpKind.FORWARD or 0 <= op.sub < split))]
        raise ScheduleError(f"the compute orders hold passes outside the schedule: {', '.join(extra[:8])}")

    fwd_t, bwd_t = float(split), 2.0
    times: dict[Op, tuple[float, float]] = {}
    pc = [0] * len(orders)
    clock = [0.0] * len(orders)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while pc[r] < len(order):
                op = order[pc[r]]
                if op.kind == OpKind.FORWARD:
                    deps = [Op(OpKind.FORWARD, op.stage - 1, -1, op.mb)] if op.stage > 0 else []
                    dur = fwd_t
                else:
                    deps = [Op(OpKind.FORWARD, op.stage, -1, op.mb)]
                    nxt = next_sub(op.stage, op.sub, n_stages, split)
                    if nxt is not None:
                        deps.append(Op(OpKind.BACKWARD, nxt[0], nxt[1], op.mb))
                    dur = bwd_t
                if any(d not in times for d in deps):
                    break
                start = max([clock[r]] + [times[d][1] for d in deps])
                times[op] = (start, start + dur)
                clock[r] = start + dur
                pc[r] += 1
                progress = True
    if any(pc[r] < len(o) for r, o in enumerate(orders)):
        stuck = [f"rank {r} at `{o[pc[r]]}` (#{pc[r]} of its passes)" for r, o in enumerate(orders) if pc[r] < len(o)]
        raise ScheduleError("the compute orders cannot run: passes wait for each other: " + "; ".join(stuck))
    return where, times


def _unit_of(op: Op, partition: Partition) -> tuple[int, int]:
    """(stage, sub) naming the parameter unit of a pass; sub -1 when it is the whole stage."""
    if op.kind == OpKind.FORWARD or partition.split == 1:
        return (op.stage, -1)
    return (op.stage, op.sub)


def _param_actions(compute: list[Op], partition: Partition, slots: int) -> tuple[list[Op], list[list[Op]]]:
    """LOAD/FREE ops to put before the first pass and after each pass (see the module doc)."""
    units = [_unit_of(op, partition) for op in compute]
    uses: dict[tuple[int, int], list[int]] = {}
    for i, u in enumerate(units):
        uses.setdefault(u, []).append(i)
    inf = len(units) + 1

    def next_use(u: tuple[int, int], i: int) -> int:
        lst = uses[u]
        a = bisect_right(lst, i)
        return lst[a] if a < len(lst) else inf

    resident: list[tuple[int, int]] = []

    def fill(i: int) -> list[Op]:
        acts: list[Op] = []
        for u in list(resident):
            if next_use(u, i) == inf:
                resident.remove(u)
                acts.append(Op(OpKind.FREE, u[0], u[1]))
        while True:
            y = next((units[j] for j in range(i + 1, len(units)) if units[j] not in resident), None)
            if y is None:
                break
            if len(resident) < slots:
                resident.append(y)
                acts.append(Op(OpKind.LOAD_PARAMS, y[0], y[1]))
                continue
            x = max(resident, key=lambda u: next_use(u, i))
            if next_use(x, i) > next_use(y, i):
                resident.remove(x)
                acts.append(Op(OpKind.FREE, x[0], x[1]))
                resident.append(y)
                acts.append(Op(OpKind.LOAD_PARAMS, y[0], y[1]))
                continue
            break
        return acts

    before = fill(-1)
    after = [fill(i) for i in range(len(units))]
    return before, after


class _Msg(NamedTuple):
    """A message between two ranks, ready at logical time ``tau``."""

    tau: float
    fam: int
    src: int
    dst: int
    stage: int
    sub: int
    mb: int
    is_async: bool


def _global_order(msgs: list[_Msg], progress: Callable[[int, int, int], int]) -> list[_Msg]:
    """All messages in one order: by logical time; within one time, a rank's sends before its
    receives wherever that is consistent (Kahn's algorithm on send->receive edges), cycles and
    remaining ties broken by (family, pipeline progress descending, micro-batch, ranks)."""
    by_time: dict[float, list[_Msg]] = {}
    for m in msgs:
        by_time.setdefault(m.tau, []).append(m)
    out: list[_Msg] = []
    for tau in sorted(by_time):
        group = by_time[tau]
        if len(group) == 1:
            out.append(group[0])
            continue
        prio = {m: (m.fam, -progress(m.fam, m.stage, m.sub), m.mb, m.src, m.dst, m.stage, m.sub) for m in group}
        sends: dict[int, list[_Msg]] = {}
        for m in group:
            sends.setdefault(m.src, []).append(m)
        succ: dict[_Msg, list[_Msg]] = {m: [] for m in group}
        indeg = {m: 0 for m in group}
        for m in group:  # m is a receive on rank m.dst: after that rank's sends
            for first in sends.get(m.dst, ()):
                succ[first].append(m)
                indeg[m] += 1
        left = set(group)
        while left:
            ready = [m for m in left if indeg[m] == 0]
            m = min(ready or left, key=prio.__getitem__)  # no ready one: a cycle, break it
            left.discard(m)
            out.append(m)
            for n in succ[m]:
                indeg[n] -= 1
    return out


def lower(
    name: str,
    partition: Partition,
    placement: Placement,
    n_micro: int,
    orders: Sequence[Sequence[Op]],
    *,
    ckpt: str,
    optimizer: str,
    param_buffers: int = 2,
    options: dict[str, Any] | None = None,
) -> Schedule:
    """Build the complete :class:`Schedule` from per-rank compute orders.

    ``ckpt``: ``"local"`` (coupled schedules: every checkpoint stays on its rank), ``"sync"``
    (blocking transfer right before the backward) or ``"async"`` (isend/irecv when produced).
    ``optimizer``: ``"sync"`` (after VALIDATE, one sub-stage after another) or ``"async"``.
    """
    if ckpt not in ("local", "sync", "async"):
        raise ScheduleError(f"ckpt mode {ckpt!r} must be 'local', 'sync' or 'async'")
    if optimizer not in ("sync", "async"):
        raise ScheduleError(f"optimizer mode {optimizer!r} must be 'sync' or 'async'")
    if not isinstance(param_buffers, int) or param_buffers < 1:
        raise ScheduleError(f"param_buffers={param_buffers!r} must be an int >= 1 (2 = current + prefetch)")
    n_ranks, nsf, d = placement.n_ranks, partition.n_stages, partition.split
    if len(orders) != n_ranks:
        raise ScheduleError(f"{len(orders)} compute orders for {n_ranks} ranks")
    where, times = logical_times(orders, nsf, d, n_micro)

    # --- messages, keyed by one global order ----------------------------------------------------
    items: list[list[tuple[tuple, Op]]] = [[] for _ in range(n_ranks)]
    msgs: list[_Msg] = []
    routes: list[CkptRoute] = []

    def progress(fam: int, s: int, k: int) -> int:
        return s if fam == _ACT else ((nsf - 1 - s) * d + (d - 1 - k) if fam == _GRAD else s * d + k)

    for r, order in enumerate(orders):
        for seq, op in enumerate(order):
            items[r].append(((times[op][0], 1, seq), op))
            if op.kind == OpKind.FORWARD and op.stage > 0:
                prod = Op(OpKind.FORWARD, op.stage - 1, -1, op.mb)
                if where[prod] != r:
                    msgs.append(_Msg(times[prod][1], _ACT, where[prod], r, op.stage - 1, -1, op.mb, False))
            elif op.kind == OpKind.BACKWARD:
                nxt = next_sub(op.stage, op.sub, nsf, d)
                if nxt is not None:
                    prod = Op(OpKind.BACKWARD, nxt[0], nxt[1], op.mb)
                    if where[prod] != r:
                        msgs.append(_Msg(times[prod][1], _GRAD, where[prod], r, nxt[0], nxt[1], op.mb, False))
                fwd = Op(OpKind.FORWARD, op.stage, -1, op.mb)
                src = where[fwd]
                if src == r:
                    routes.append(CkptRoute(op.stage, op.sub, op.mb, r, r, "local", times[fwd][1]))
                elif ckpt == "local":
                    raise ScheduleError(
                        f"`{op}` runs on rank {r} but `{fwd}` on rank {src}: a coupled schedule keeps every "
                        f"checkpoint on its rank; build it with ckpt='sync' or 'async'")
                elif ckpt == "async":
                    tau = times[fwd][1]
                    msgs.append(_Msg(tau, _CKPT, src, r, op.stage, op.sub, op.mb, True))
                    items[r].append(((times[op][0], 0, float("inf"), _WAIT, op.stage, op.sub, op.mb),
                                     Op(OpKind.WAIT_CKPT, op.stage, op.sub, op.mb, src)))
                    routes.append(CkptRoute(op.stage, op.sub, op.mb, src, r, "async", tau))
                else:
                    tau = times[op][0]
                    msgs.append(_Msg(tau, _CKPT, src, r, op.stage, op.sub, op.mb, False))
                    routes.append(CkptRoute(op.stage, op.sub, op.mb, src, r, "sync", tau))
    for idx, (tau, fam, src, dst, s, k, j, a) in enumerate(_global_order(msgs, progress)):
        key = (tau, 0, idx)
        items[src].append((key, Op(_SEND_OF[fam], s, k, j, dst, a)))
        items[dst].append((key, Op(_RECV_OF[fam], s, k, j, src, a)))

    # --- per rank: merge by key, add params / gradients / optimizer ------------------------------
    lists: list[tuple[Op, ...]] = []
    for r in range(n_ranks):
        merged = [op for _, op in sorted(items[r], key=lambda kv: kv[0])]
        compute = [op for op in merged if op.kind in (OpKind.FORWARD, OpKind.BACKWARD)]
        before, after = _param_actions(compute, partition, param_buffers)
        last_b: dict[tuple[int, int], int] = {}
        for i, op in enumerate(compute):
            if op.kind == OpKind.BACKWARD:
                last_b[(op.stage, op.sub)] = i
        grads_after: dict[int, tuple[int, int]] = {i: u for u, i in last_b.items()}
        out: list[Op] = list(before)
        stepped: list[tuple[int, int]] = []
        ci = 0
        for op in merged:
            out.append(op)
            if op.kind in (OpKind.FORWARD, OpKind.BACKWARD):
                if ci in grads_after:
                    s, k = grads_after[ci]
                    out.append(Op(OpKind.OFFLOAD_GRADS, s, k))
                    stepped.append((s, k))
                    if optimizer == "async":
                        out.append(Op(OpKind.OPTIM_STEP, s, k, is_async=True))
                out.extend(after[ci])
                ci += 1
        out.append(Op(OpKind.VALIDATE))
        if optimizer == "sync":
            out.extend(Op(OpKind.OPTIM_STEP, s, k) for s, k in stepped)
        lists.append(tuple(out))

    # --- checkpoint plan with op positions ------------------------------------------------------
    index: dict[tuple[int, Op], int] = {}
    for r, ops in enumerate(lists):
        for i, op in enumerate(ops):
            if op.kind in (OpKind.SEND_CKPT, OpKind.RECV_CKPT):
                index[(r, op)] = i
    plan = []
    for rt in routes:
        if rt.mode == "local":
            plan.append(rt)
            continue
        a = rt.mode == "async"
        si = index[(rt.src, Op(OpKind.SEND_CKPT, rt.stage, rt.sub, rt.mb, rt.dst, a))]
        di = index[(rt.dst, Op(OpKind.RECV_CKPT, rt.stage, rt.sub, rt.mb, rt.src, a))]
        plan.append(CkptRoute(rt.stage, rt.sub, rt.mb, rt.src, rt.dst, rt.mode, rt.step, si, di))
    plan.sort(key=lambda rt: (rt.stage, rt.sub, rt.mb))
    opts = {"ckpt": ckpt, "optimizer": optimizer, "param_buffers": param_buffers}
    opts.update(options or {})
    return Schedule(name, n_ranks, n_micro, partition, placement, tuple(lists), tuple(plan), opts)
