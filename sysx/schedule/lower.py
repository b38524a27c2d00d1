"""Turn per-rank compute orders (FORWARD/BACKWARD only) into complete op lists.

Every builder only decides, per rank, in which order its forward and backward passes run; this
module adds everything else, the same way for every schedule: send/recv pairs in one global order
(no deadlock), parameter loads and frees over ``param_buffers`` GPU buffers, gradient offloads,
optimizer steps and VALIDATE. An order that cannot run is an error naming the stuck passes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import NamedTuple

from sysx.partition import Partition, RankAssignment
from sysx.schedule.ops import (
    RECV_OF,
    SEND_OF,
    B,
    CkptMode,
    CkptRoute,
    F,
    Message,
    Op,
    OpKind,
    OptimizerMode,
    Schedule,
    ScheduleError,
    ScheduleOptions,
    grad_producer,
)

# An op list under construction: (sort key, op); merging by key interleaves the passes' ops.
Keyed = list[tuple[tuple, Op]]


def _split_backwards(orders: Sequence[Sequence[Op]], parts: int) -> list[list[Op]]:
    """Every backward pass of the builders' orders as ``parts`` passes in a row, one per part of its
    micro-batch's rows (``ScheduleOptions.backward_parts``): the next rank's backward of part 0 can
    start while this rank computes part 1."""
    if parts == 1:
        return [list(order) for order in orders]
    out: list[list[Op]] = []
    for order in orders:
        lst: list[Op] = []
        for op in order:
            if op.kind == OpKind.BACKWARD:
                lst += [B(op.stage, op.sub, op.mb * parts + p) for p in range(parts)]
            else:
                lst.append(op)
        out.append(lst)
    return out


def _check_orders(orders: Sequence[Sequence[Op]], partition: Partition, n_micro: int, parts: int = 1) -> dict[Op, int]:
    """The rank of every pass; every forward and backward pass (of every part) must appear exactly once,
    and a micro-batch's backward parts of one sub-stage on one rank."""
    n_stages, split = partition.n_stages, partition.split
    where: dict[Op, int] = {}
    for r, order in enumerate(orders):
        for op in order:
            if op.kind not in (OpKind.FORWARD, OpKind.BACKWARD):
                raise ScheduleError(f"rank {r}: compute orders hold FORWARD/BACKWARD only, got `{op}`")
            if op in where:
                raise ScheduleError(f"`{op}` appears twice in the compute orders (ranks {where[op]} and {r})")
            where[op] = r
    missing = [str(F(s, j)) for s in range(n_stages) for j in range(n_micro) if F(s, j) not in where]
    missing += [
        str(B(s, k, j))
        for s in range(n_stages)
        for k in range(split)
        for j in range(n_micro * parts)
        if B(s, k, j) not in where
    ]
    if missing:
        raise ScheduleError(f"the compute orders miss {len(missing)} pass(es): {', '.join(missing[:8])}")
    if len(where) != n_stages * n_micro * (1 + split * parts):
        extra = [
            str(op)
            for op in where
            if not (
                0 <= op.stage < n_stages
                and 0 <= op.mb < n_micro * (1 if op.kind == OpKind.FORWARD else parts)
                and (op.kind == OpKind.FORWARD or 0 <= op.sub < split)
            )
        ]
        raise ScheduleError(f"the compute orders hold passes outside the schedule: {', '.join(extra[:8])}")
    apart = [
        str(op)
        for op, r in where.items()
        if op.kind == OpKind.BACKWARD and op.mb % parts and where[B(op.stage, op.sub, op.mb - op.mb % parts)] != r
    ]
    if apart:
        raise ScheduleError(
            f"backward parts {', '.join(apart[:8])} run on another rank than their micro-batch's part 0: "
            "the parts share one checkpoint, received once"
        )
    return where


def _inputs(op: Op, partition: Partition, head_igrad: frozenset[int] = frozenset(), parts: int = 1) -> list[Op]:
    """The passes whose results ``op`` consumes (its checkpoint's forward, its input or output gradient)."""
    if op.kind == OpKind.FORWARD:
        return [F(op.stage - 1, op.mb)] if op.stage > 0 else []
    deps = [F(op.stage, op.mb // parts)]
    prod = grad_producer(op, partition, head_igrad, parts)
    if prod is not None:
        deps.append(prod)
    return deps


def logical_times(
    orders: Sequence[Sequence[Op]],
    partition: Partition,
    n_micro: int,
    head_igrad: frozenset[int] = frozenset(),
    parts: int = 1,
) -> tuple[dict[Op, int], dict[Op, tuple[float, float]]]:
    """Rank of every pass, and its (start, end) on the logical timeline (see docs/architecture.md);
    ``orders`` with every backward in its ``parts`` (:func:`_split_backwards`)."""
    where = _check_orders(orders, partition, n_micro, parts)
    duration = {OpKind.FORWARD: float(partition.split), OpKind.BACKWARD: 2.0 / parts}
    times: dict[Op, tuple[float, float]] = {}
    pc = [0] * len(orders)
    clock = [0.0] * len(orders)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while pc[r] < len(order):
                op = order[pc[r]]
                deps = _inputs(op, partition, head_igrad, parts)
                if any(d not in times for d in deps):
                    break
                start = max([clock[r]] + [times[d][1] for d in deps])
                times[op] = (start, start + duration[op.kind])
                clock[r] = start + duration[op.kind]
                pc[r] += 1
                progress = True
    if any(pc[r] < len(o) for r, o in enumerate(orders)):
        stuck = [f"rank {r} at `{o[pc[r]]}` (#{pc[r]} of its passes)" for r, o in enumerate(orders) if pc[r] < len(o)]
        raise ScheduleError("the compute orders cannot run: passes wait for each other: " + "; ".join(stuck))
    return where, times


def _check_head_igrad(partition: Partition, n_micro: int, head_igrad: frozenset[int]) -> None:
    """The Head's input gradient moves to its forward only where the Head is a stage of its own."""
    last = partition.n_stages - 1
    if not partition.head_alone:
        raise ScheduleError(
            "head_igrad needs the Head as a forward stage of its own with d = 1 (SysX's block layout), "
            f"not {partition.n_stages} stages of d = {partition.split} ending in layers "
            f"{partition.stage_layers(last).start}..{partition.stage_layers(last).stop - 1}"
        )
    bad = sorted(j for j in head_igrad if not 0 <= j < n_micro)
    if bad:
        raise ScheduleError(f"head_igrad names micro-batches {bad} outside 0..{n_micro - 1}")


def _unit_of(op: Op, partition: Partition) -> tuple[int, int]:
    """(stage, sub) naming the parameter unit of a pass; sub -1 when it is the whole stage."""
    if op.kind == OpKind.FORWARD or partition.split == 1:
        return (op.stage, -1)
    return (op.stage, op.sub)


def _param_actions(compute: list[Op], partition: Partition, slots: int) -> tuple[list[Op], list[list[Op]]]:
    """LOAD/FREE ops to put before the first pass and after each pass (see docs/architecture.md)."""
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
    kind: Message
    src: int
    dst: int
    stage: int
    sub: int
    mb: int
    is_async: bool


def _global_order(msgs: list[_Msg], progress: Callable[[Message, int, int], int]) -> list[_Msg]:
    """All messages in one order: by logical time; within one time, a rank's sends before its
    receives wherever that is consistent (Kahn's algorithm on send->receive edges), cycles and
    remaining ties broken by (message kind, pipeline progress descending, micro-batch, ranks)."""
    by_time: dict[float, list[_Msg]] = {}
    for m in msgs:
        by_time.setdefault(m.tau, []).append(m)
    out: list[_Msg] = []
    for tau in sorted(by_time):
        group = by_time[tau]
        if len(group) == 1:
            out.append(group[0])
            continue
        prio = {m: (m.kind, -progress(m.kind, m.stage, m.sub), m.mb, m.src, m.dst, m.stage, m.sub) for m in group}
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


def _messages(
    orders: Sequence[Sequence[Op]],
    where: dict[Op, int],
    times: dict[Op, tuple[float, float]],
    partition: Partition,
    ckpt: CkptMode,
    head_igrad: frozenset[int] = frozenset(),
    parts: int = 1,
) -> tuple[list[Keyed], list[_Msg], list[CkptRoute]]:
    """Every rank's passes keyed by their logical start, the messages between ranks, WAIT_CKPTs,
    and the route of every checkpoint."""
    items: list[Keyed] = [[] for _ in orders]
    msgs: list[_Msg] = []
    routes: list[CkptRoute] = []
    for r, order in enumerate(orders):
        for seq, op in enumerate(order):
            items[r].append(((times[op][0], 1, seq), op))
            if op.kind == OpKind.FORWARD and op.stage > 0:
                prod = F(op.stage - 1, op.mb)
                if where[prod] != r:
                    msgs.append(_Msg(times[prod][1], Message.ACT, where[prod], r, op.stage - 1, -1, op.mb, False))
            elif op.kind == OpKind.BACKWARD:
                nxt = partition.next_sub(op.stage, op.sub)
                grad = grad_producer(op, partition, head_igrad, parts)
                if nxt is not None and grad is not None and where[grad] != r:
                    # named by the sub-stage it is the input gradient of, whichever pass computed it
                    msgs.append(_Msg(times[grad][1], Message.GRAD, where[grad], r, nxt[0], nxt[1], op.mb, False))
                if op.mb % parts == 0:  # one checkpoint for the micro-batch's parts, routed to its first
                    _route_checkpoint(op, op.mb // parts, r, where, times, ckpt, items[r], msgs, routes)
    return items, msgs, routes


def _route_checkpoint(
    op: Op,
    mb: int,
    r: int,
    where: dict[Op, int],
    times: dict[Op, tuple[float, float]],
    ckpt: CkptMode,
    items: Keyed,
    msgs: list[_Msg],
    routes: list[CkptRoute],
) -> None:
    """The route of the checkpoint of backward ``op`` (the first part of micro-batch ``mb``) from its
    forward; a message (and a WAIT_CKPT) across ranks."""
    fwd = F(op.stage, mb)
    src = where[fwd]
    if src == r:
        routes.append(CkptRoute(op.stage, op.sub, mb, r, r, "local", times[fwd][1]))
    elif ckpt == "local":
        raise ScheduleError(
            f"`{op}` runs on rank {r} but `{fwd}` on rank {src}: a coupled schedule keeps every "
            f"checkpoint on its rank; build it with ckpt='sync' or 'async'"
        )
    elif ckpt == "async":
        tau = times[fwd][1]
        msgs.append(_Msg(tau, Message.CKPT, src, r, op.stage, op.sub, mb, True))
        # right before the backward, after the messages keyed at its start
        items.append(
            (
                (times[op][0], 0, float("inf"), op.stage, op.sub, mb),
                Op(OpKind.WAIT_CKPT, op.stage, op.sub, mb, src),
            )
        )
        routes.append(CkptRoute(op.stage, op.sub, mb, src, r, "async", tau))
    else:
        tau = times[op][0]
        msgs.append(_Msg(tau, Message.CKPT, src, r, op.stage, op.sub, mb, False))
        routes.append(CkptRoute(op.stage, op.sub, mb, src, r, "sync", tau))


def _add_messages(items: list[Keyed], msgs: list[_Msg], partition: Partition) -> None:
    """A send and a receive per message, both keyed by its place in the one global order."""
    nsf, d = partition.n_stages, partition.split

    def progress(kind: Message, s: int, k: int) -> int:
        if kind == Message.ACT:
            return s
        return (nsf - 1 - s) * d + (d - 1 - k) if kind == Message.GRAD else s * d + k

    for idx, (tau, kind, src, dst, s, k, j, a) in enumerate(_global_order(msgs, progress)):
        key = (tau, 0, idx)
        items[src].append((key, Op(SEND_OF[kind], s, k, j, dst, a)))
        items[dst].append((key, Op(RECV_OF[kind], s, k, j, src, a)))


def _add_param_ops(ops: list[Op], partition: Partition, slots: int) -> list[Op]:
    """LOAD_PARAMS / FREE around the passes of one rank's list (see docs/architecture.md)."""
    compute = [op for op in ops if op.kind in (OpKind.FORWARD, OpKind.BACKWARD)]
    before, after = _param_actions(compute, partition, slots)
    out = list(before)
    ci = 0
    for op in ops:
        out.append(op)
        if op.kind in (OpKind.FORWARD, OpKind.BACKWARD):
            out.extend(after[ci])
            ci += 1
    return out


def _add_optimizer_ops(ops: list[Op], optimizer: OptimizerMode) -> list[Op]:
    """OFFLOAD_GRADS right after a sub-stage's last backward, the async OPTIM_STEP right after
    it, VALIDATE at the end and the sync OPTIM_STEPs after VALIDATE."""
    last_b = {(op.stage, op.sub): i for i, op in enumerate(ops) if op.kind == OpKind.BACKWARD}
    grads_after = {i: u for u, i in last_b.items()}
    out: list[Op] = []
    for i, op in enumerate(ops):
        out.append(op)
        if i in grads_after:
            s, k = grads_after[i]
            out.append(Op(OpKind.OFFLOAD_GRADS, s, k))
            if optimizer == "async":
                out.append(Op(OpKind.OPTIM_STEP, s, k, is_async=True))
    steps = [Op(OpKind.OPTIM_STEP, op.stage, op.sub) for op in out if op.kind == OpKind.OFFLOAD_GRADS]
    out.append(Op(OpKind.VALIDATE))
    if optimizer == "sync":
        out.extend(steps)
    return out


def lower(
    name: str,
    partition: Partition,
    assignment: RankAssignment,
    n_micro: int,
    orders: Sequence[Sequence[Op]],
    *,
    ckpt: CkptMode,
    optimizer: OptimizerMode,
    param_buffers: int = 2,
    cfg: int | None = None,
    head_igrad: frozenset[int] = frozenset(),
    backward_parts: int = 1,
) -> Schedule:
    """Build the complete :class:`Schedule` from per-rank compute orders, pass by pass: logical
    times, messages, parameter loads/frees, gradient offloads and optimizer steps, checkpoint plan.

    ``ckpt`` and ``optimizer`` are the :class:`ScheduleOptions` modes; ``cfg`` the sysx ablation;
    ``head_igrad`` the micro-batches whose Head input gradient its forward computes;
    ``backward_parts`` the parts each backward of ``orders`` runs in (:func:`_split_backwards`).
    """
    options = ScheduleOptions(
        ckpt, optimizer, param_buffers, cfg, head_igrad=frozenset(head_igrad), backward_parts=backward_parts
    )
    if len(orders) != assignment.n_ranks:
        raise ScheduleError(f"{len(orders)} compute orders for {assignment.n_ranks} ranks")
    if head_igrad:
        _check_head_igrad(partition, n_micro, options.head_igrad)
    parts = options.backward_parts
    orders = _split_backwards(orders, parts)
    where, times = logical_times(orders, partition, n_micro, options.head_igrad, parts)
    items, msgs, routes = _messages(orders, where, times, partition, ckpt, options.head_igrad, parts)
    _add_messages(items, msgs, partition)
    lists = []
    for keyed in items:
        merged = [op for _, op in sorted(keyed, key=lambda kv: kv[0])]
        # parameter ops first: the offload of a sub-stage then lands right after its last backward
        lists.append(_add_optimizer_ops(_add_param_ops(merged, partition, param_buffers), optimizer))
    routes.sort(key=lambda rt: (rt.stage, rt.sub, rt.mb))
    bare = Schedule(name, assignment.n_ranks, n_micro, partition, assignment, (), tuple(routes), options)
    return bare.with_ops(lists)
