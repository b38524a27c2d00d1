"""Execute a schedule's op lists on a model of the machine: timeline, bubble ratio, memory.

Every rank runs its list in order on one cursor (its compute stream). An op starts when the
cursor reaches it and its inputs are ready:

- FORWARD/BACKWARD occupy the GPU for their cost; they wait for their unit's LOAD_PARAMS.
- LOAD_PARAMS (H2D stream) and OFFLOAD_GRADS (D2H stream) run in list order on their own
  copy stream, each starting when the cursor reaches it and the stream is free; they do not
  hold the cursor.
- synchronous SEND_*/RECV_*: the receiver waits for the data. A send costs its transfer time on
  the sender; with ``rendezvous`` it also waits until the receiver has posted its receive
  (NCCL/gloo blocking semantics), otherwise it is eager (buffered).
- asynchronous SEND_CKPT/RECV_CKPT: posting costs nothing; the transfer starts once both sides
  have posted; WAIT_CKPT holds the receiver's cursor until the data has arrived.
- OPTIM_STEP async: on one of ``optim_workers`` CPU workers of the rank (unlimited when None),
  from the end of the sub-stage's offload. OPTIM_STEP sync: holds the cursor.
- VALIDATE: a barrier over all ranks once each rank's offloads, async sends and optimizer steps
  are done, plus the all-reduce latency.

The iteration ends when the last op anywhere ends; bubble ratio = 1 - busy GPU time / iteration
(per rank; overall: mean busy over ranks). With :class:`~sysx.schedule.costs.UnitCosts` this is
exactly the unit-cost model of the issue/paper.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Union

from sysx.schedule.costs import Costs, CostTable, UnitCosts
from sysx.schedule.ops import Op, OpKind, Schedule, ScheduleError

LANES = ("gpu", "h2d", "d2h", "p2p", "cpu")
_GPU, _H2D, _D2H, _P2P, _CPU = range(5)
(_LOAD, _FREE, _FWD, _BWD, _SEND, _RECV, _ASEND, _ARECV, _WAIT, _OFFL, _OPTA, _OPTS, _VAL) = range(13)
_P, _G, _C, _W = range(4)  # memory categories: params, grads, checkpoints, working activations


@dataclass(frozen=True, slots=True)
class Event:
    """One box of the timeline: ``op`` ran on ``rank``'s ``lane`` from ``start`` to ``end``.

    Transfers between ranks are events of the sender's ``p2p`` lane (``op`` is the SEND).
    """

    rank: int
    lane: str
    op: Op
    start: float
    end: float


@dataclass
class Timeline:
    """What :func:`simulate` returns (times in the cost model's unit, memory in bytes or units)."""

    name: str
    n_ranks: int
    iteration: float
    busy: list[float]
    bubble: list[float]
    bubble_ratio: float
    gpu_end: list[float]
    peak_gpu: list[float]
    peak_params: list[float]
    peak_grads: list[float]
    peak_ckpts: list[float]
    peak_work: list[float]
    host: list[float]
    shm: list[float]
    gpus_per_node: int
    unit: str
    events: list[Event] = field(default_factory=list)
    schedule: Schedule | None = None

    def summary(self) -> dict:
        """JSON-ready numbers (no events)."""
        return {
            "schedule": self.name, "ranks": self.n_ranks, "iteration": self.iteration,
            "bubble_ratio": self.bubble_ratio, "busy": self.busy, "bubble": self.bubble,
            "idle": [self.iteration - b for b in self.busy], "gpu_end": self.gpu_end,
            "peak_gpu": self.peak_gpu, "peak_params": self.peak_params, "peak_grads": self.peak_grads,
            "peak_ckpts": self.peak_ckpts, "peak_work": self.peak_work, "host_per_rank": self.host,
            "shm_per_node": self.shm, "gpus_per_node": self.gpus_per_node, "unit": self.unit,
        }


class Deadlock(ScheduleError):
    """The ranks wait for each other; ``stuck`` lists (rank, op index, op, reason)."""

    def __init__(self, message: str, stuck: list[tuple[int, int, Op, str]]):
        super().__init__(message)
        self.stuck = stuck


@dataclass
class _Program:
    code: list[list[tuple]]
    msg_src: list[int]
    msg_dst: list[int]
    msg_fam: list[int]
    msg_idx: list[int]
    msg_op: list[tuple[int, int, int]]
    n_units: int


def _unit_index(op: Op, nsf: int, d: int) -> int:
    return op.stage if op.sub < 0 else nsf + op.stage * d + op.sub


def compile_schedule(schedule: Schedule) -> _Program:
    """Integer form of the op lists (cached on the schedule object)."""
    cached = schedule.__dict__.get("_sysx_program")
    if cached is not None:
        return cached
    p = schedule.partition
    nsf, d = p.n_stages, p.split
    msg_id: dict[tuple, int] = {}
    src: list[int] = []
    dst: list[int] = []
    fam: list[int] = []
    idx: list[int] = []
    where: list[tuple[int, int, int]] = []

    def mid(op: Op, rank: int, sending: bool) -> int:
        a, b = (rank, op.peer) if sending else (op.peer, rank)
        f = op.message[0]
        key = (f, op.stage, op.sub, op.mb, a, b)
        m = msg_id.get(key)
        if m is None:
            m = msg_id[key] = len(src)
            src.append(a)
            dst.append(b)
            fam.append(f)
            idx.append(op.stage if f == 0 else op.stage * d + op.sub)
            where.append((op.stage, op.sub, op.mb))
        return m

    code: list[list[tuple]] = []
    for r, ops in enumerate(schedule.ops):
        resident: list[tuple[int, range]] = []
        seen_g: set[int] = set()
        prog: list[tuple] = []
        for i, op in enumerate(ops):
            k = op.kind
            if k == OpKind.LOAD_PARAMS:
                u = _unit_index(op, nsf, d)
                resident.append((u, p.layers(op.stage, op.sub)))
                prog.append((_LOAD, u, i))
            elif k == OpKind.FREE:
                u = _unit_index(op, nsf, d)
                resident[:] = [x for x in resident if x[0] != u]
                prog.append((_FREE, u, i))
            elif k in (OpKind.FORWARD, OpKind.BACKWARD):
                lay = p.layers(op.stage, -1 if k == OpKind.FORWARD else op.sub)
                u = next((x[0] for x in reversed(resident)
                          if x[1].start <= lay.start and lay.stop <= x[1].stop), -1)
                if k == OpKind.FORWARD:
                    prog.append((_FWD, op.stage, u, i))
                else:
                    g = op.stage * d + op.sub
                    prog.append((_BWD, g, u, i, g not in seen_g))
                    seen_g.add(g)
            elif k in (OpKind.SEND_ACT, OpKind.SEND_GRAD, OpKind.SEND_CKPT):
                prog.append((_ASEND if op.is_async else _SEND, mid(op, r, True), i))
            elif k in (OpKind.RECV_ACT, OpKind.RECV_GRAD, OpKind.RECV_CKPT):
                prog.append((_ARECV if op.is_async else _RECV, mid(op, r, False), i))
            elif k == OpKind.WAIT_CKPT:
                prog.append((_WAIT, mid(Op(OpKind.RECV_CKPT, op.stage, op.sub, op.mb, op.peer), r, False), i))
            elif k == OpKind.OFFLOAD_GRADS:
                prog.append((_OFFL, op.stage * d + op.sub, i))
            elif k == OpKind.OPTIM_STEP:
                prog.append((_OPTA if op.is_async else _OPTS, op.stage * d + op.sub, i))
            elif k == OpKind.VALIDATE:
                prog.append((_VAL, 0, i))
        code.append(prog)
    out = _Program(code, src, dst, fam, idx, where, nsf + nsf * d)
    object.__setattr__(schedule, "_sysx_program", out)
    return out


def run_program(schedule: Schedule, tab: CostTable, *, rendezvous: bool, record: bool, memory: bool) -> dict:
    """The discrete-event engine behind :func:`simulate` and the validator's deadlock check."""
    prog = compile_schedule(schedule)
    code = prog.code
    R = len(code)
    M = len(prog.msg_src)
    msg_src, msg_fam, msg_idx = prog.msg_src, prog.msg_fam, prog.msg_idx
    xfer = [(tab.act_xfer, tab.grad_xfer, tab.ckpt_xfer)[f][i] for f, i in zip(msg_fam, msg_idx)]
    ckmem = [tab.ckpt_mem[i] if f == 2 else 0.0 for f, i in zip(msg_fam, msg_idx)] if memory else [0.0] * M
    fwd, bwd, opt, offload = tab.fwd, tab.bwd, tab.opt, tab.offload
    load = list(tab.load_stage) + list(tab.load_sub)
    nsf, d = len(fwd), tab.split
    if memory:
        param_mem = list(tab.param_stage) + list(tab.param_sub)
        grad_mem, ckpt_mem, fwork, bwork = tab.grad_mem, tab.ckpt_mem, tab.fwd_work, tab.bwd_work
        f_ckpt = [sum(ckpt_mem[s * d + k] for k in range(d)) for s in range(nsf)]
    workers = tab.optim_workers

    pcs = [0] * R
    clock = [0.0] * R
    busy = [0.0] * R
    gpu_end = [0.0] * R
    h2d = [0.0] * R
    d2h = [0.0] * R
    cpu_end = [0.0] * R
    asend_end = [0.0] * R
    unit_ready = [[0.0] * prog.n_units for _ in range(R)]
    offl_end: dict[int, float] = {}
    heaps: list[list[float]] = [[] for _ in range(R)]
    send_post: list[float | None] = [None] * M
    recv_post: list[float | None] = [None] * M
    arrival: list[float | None] = [None] * M
    waiters: list[list[int]] = [[] for _ in range(M)]
    mem: list[list[tuple[float, float, int]]] = [[] for _ in range(R)]
    events: list[tuple] = []
    arrived: list[int] = []
    val_time: list[float | None] = [None]
    val_wait: list[int] = []
    blocked_on: list[str] = [""] * R
    queue = deque(range(R))
    inq = [True] * R

    def wake(m: int) -> None:
        w = waiters[m]
        if w:
            for x in w:
                if not inq[x]:
                    inq[x] = True
                    queue.append(x)
            w.clear()

    while queue:
        r = queue.popleft()
        inq[r] = False
        ops = code[r]
        n = len(ops)
        pc = pcs[r]
        t = clock[r]
        ur = unit_ready[r]
        mr = mem[r]
        while pc < n:
            ins = ops[pc]
            c = ins[0]
            if c == _FWD:
                s = ins[1]
                u = ins[2]
                st = t if u < 0 or t >= ur[u] else ur[u]
                en = st + fwd[s]
                busy[r] += en - st
                t = gpu_end[r] = en
                if memory:
                    w = fwork[s]
                    mr.append((st, w, _W))
                    mr.append((en, -w, _W))
                    mr.append((en, f_ckpt[s], _C))
                if record:
                    events.append((r, _GPU, ins[3], st, en))
            elif c == _BWD:
                g = ins[1]
                u = ins[2]
                st = t if u < 0 or t >= ur[u] else ur[u]
                en = st + bwd[g]
                busy[r] += en - st
                t = gpu_end[r] = en
                if memory:
                    if ins[4]:
                        mr.append((st, grad_mem[g], _G))
                    w = bwork[g]
                    mr.append((st, w, _W))
                    mr.append((en, -w, _W))
                    mr.append((en, -ckpt_mem[g], _C))
                if record:
                    events.append((r, _GPU, ins[3], st, en))
            elif c == _SEND:
                m = ins[1]
                if rendezvous:
                    rp = recv_post[m]
                    if rp is None:
                        waiters[m].append(r)
                        blocked_on[r] = "recv"
                        break
                    st = t if t >= rp else rp
                else:
                    st = t
                en = st + xfer[m]
                t = en
                arrival[m] = en
                wake(m)
                if memory and ckmem[m]:
                    mr.append((en, -ckmem[m], _C))
                if record:
                    events.append((r, _P2P, ins[2], st, en))
            elif c == _RECV:
                m = ins[1]
                if recv_post[m] is None:
                    recv_post[m] = t
                    wake(m)
                a = arrival[m]
                if a is None:
                    waiters[m].append(r)
                    blocked_on[r] = "send"
                    break
                if a > t:
                    t = a
                if memory and ckmem[m]:
                    mr.append((t, ckmem[m], _C))
            elif c == _LOAD:
                u = ins[1]
                st = t if t >= h2d[r] else h2d[r]
                en = st + load[u]
                h2d[r] = ur[u] = en
                if memory:
                    mr.append((st, param_mem[u], _P))
                if record:
                    events.append((r, _H2D, ins[2], st, en))
            elif c == _FREE:
                if memory:
                    mr.append((t, -param_mem[ins[1]], _P))
            elif c == _ASEND or c == _ARECV:
                m = ins[1]
                if c == _ASEND:
                    send_post[m] = t
                    other = recv_post[m]
                else:
                    recv_post[m] = t
                    other = send_post[m]
                    if memory and ckmem[m]:
                        mr.append((t, ckmem[m], _C))
                if other is not None:
                    st = t if t >= other else other
                    en = st + xfer[m]
                    arrival[m] = en
                    sr = msg_src[m]
                    if en > asend_end[sr]:
                        asend_end[sr] = en
                    if memory and ckmem[m]:
                        mem[sr].append((en, -ckmem[m], _C))
                    if record:
                        events.append((sr, _P2P, -1 - m, st, en))
                    wake(m)
            elif c == _WAIT:
                m = ins[1]
                a = arrival[m]
                if a is None:
                    waiters[m].append(r)
                    blocked_on[r] = "ckpt"
                    break
                if a > t:
                    t = a
            elif c == _OFFL:
                g = ins[1]
                st = t if t >= d2h[r] else d2h[r]
                en = st + offload[g]
                d2h[r] = offl_end[g] = en
                if memory:
                    mr.append((en, -grad_mem[g], _G))
                if record:
                    events.append((r, _D2H, ins[2], st, en))
            elif c == _OPTA:
                g = ins[1]
                ready = offl_end.get(g, t)
                if workers is None:
                    st = ready
                else:
                    hp = heaps[r]
                    if len(hp) < workers:
                        st = ready
                    else:
                        free = heapq.heappop(hp)
                        st = ready if ready >= free else free
                en = st + opt[g]
                if workers is not None:
                    heapq.heappush(heaps[r], en)
                if en > cpu_end[r]:
                    cpu_end[r] = en
                if record:
                    events.append((r, _CPU, ins[2], st, en))
            elif c == _OPTS:
                g = ins[1]
                ready = offl_end.get(g, t)
                st = t if t >= ready else ready
                en = st + opt[g]
                t = en
                if en > cpu_end[r]:
                    cpu_end[r] = en
                if record:
                    events.append((r, _CPU, ins[2], st, en))
            else:  # _VAL
                if val_time[0] is None:
                    if r not in arrived:
                        arrived.append(r)
                        clock[r] = t
                    if len(arrived) < R:
                        val_wait.append(r)
                        blocked_on[r] = "validate"
                        break
                    top = 0.0
                    for x in range(R):
                        top = max(top, clock[x], d2h[x], cpu_end[x], asend_end[x])
                    val_time[0] = top + tab.allreduce
                    for x in val_wait:
                        if not inq[x]:
                            inq[x] = True
                            queue.append(x)
                    val_wait.clear()
                t = val_time[0]
            pc += 1
        pcs[r] = pc
        clock[r] = t

    unfinished = [r for r in range(R) if pcs[r] < len(code[r])]
    if unfinished:
        stuck = []
        for r in unfinished:
            i = _op_index(code[r][pcs[r]])
            op = schedule.ops[r][i]
            stuck.append((r, i, op, blocked_on[r]))
        lines = []
        for r, i, op, why in stuck:
            if why == "validate":
                lines.append(f"rank {r} op #{i} `{op}` waits at the VALIDATE barrier")
            elif op.kind == OpKind.WAIT_CKPT:
                lines.append(f"rank {r} op #{i} `{op}` waits for the checkpoint from rank {op.peer} "
                             f"(SEND_CKPT s{op.stage}.{op.sub} mb{op.mb} ->r{r} never posted)")
            else:
                partner = {OpKind.SEND_ACT: "RECV_ACT", OpKind.SEND_GRAD: "RECV_GRAD", OpKind.SEND_CKPT: "RECV_CKPT",
                           OpKind.RECV_ACT: "SEND_ACT", OpKind.RECV_GRAD: "SEND_GRAD",
                           OpKind.RECV_CKPT: "SEND_CKPT"}.get(op.kind, "?")
                lines.append(f"rank {r} op #{i} `{op}` waits for rank {op.peer} to reach its {partner} "
                             f"(rank {op.peer} is at op #{pcs[op.peer]}"
                             + (f" `{schedule.ops[op.peer][_op_index(code[op.peer][pcs[op.peer]])]}`)"
                                if pcs[op.peer] < len(code[op.peer]) else ", finished)"))
        raise Deadlock(f"schedule {schedule.name!r} deadlocks: " + "; ".join(lines), stuck)

    iteration = max(max(clock), max(cpu_end), max(d2h), max(h2d)) if R else 0.0
    return {"iteration": iteration, "busy": busy, "gpu_end": gpu_end, "mem": mem, "events": events,
            "clock": clock}


def _op_index(ins: tuple) -> int:
    return ins[3] if ins[0] in (_FWD, _BWD) else ins[-1]


def _peaks(mem: list[tuple[float, float, int]]) -> tuple[float, list[float]]:
    mem.sort(key=lambda e: (e[0], e[1]))
    total = peak = 0.0
    cat = [0.0] * 4
    cpk = [0.0] * 4
    for _, delta, k in mem:
        total += delta
        cat[k] += delta
        if total > peak:
            peak = total
        if cat[k] > cpk[k]:
            cpk[k] = cat[k]
    return peak, cpk


def host_memory(schedule: Schedule, tab: CostTable, gpus_per_node: int) -> tuple[list[float], list[float]]:
    """Host bytes per rank (owned sub-stages' optimizer state) and shared bytes per node."""
    p, pl = schedule.partition, schedule.placement
    d = p.split
    host = [0.0] * schedule.n_ranks
    n_nodes = (schedule.n_ranks + gpus_per_node - 1) // gpus_per_node
    layers: list[set[int]] = [set() for _ in range(n_nodes)]
    for s in range(p.n_stages):
        layers[pl.fwd_rank[s] // gpus_per_node].update(p.stage_layers(s))
        for k in range(d):
            r = pl.bwd_rank[s][k]
            host[r] += tab.params_sub[s * d + k] * tab.host_bytes_per_param
            layers[r // gpus_per_node].update(p.sub_layers(s, k))
    # shared memory per node: the 16-bit copy of every layer a rank of the node owns or runs forward
    per_layer = [0.0] * p.n_layers
    for s in range(p.n_stages):
        for k in range(d):
            rng = p.sub_layers(s, k)
            share = tab.params_sub[s * d + k] * tab.param_bytes / max(1, len(rng))
            for i in rng:
                per_layer[i] = share
    shm = [sum(per_layer[i] for i in ls) for ls in layers]
    return host, shm


CostsLike = Union[Costs, UnitCosts, CostTable]


def simulate(schedule: Schedule, costs: CostsLike | None = None, *, record: bool = True, memory: bool = True,
             rendezvous: bool | None = None, gpus_per_node: int | None = None) -> Timeline:
    """Run ``schedule`` under ``costs`` (unit costs 1/2/0 by default) and return its timeline.

    ``record=False`` skips the per-op events and ``memory=False`` the memory sweep (faster, for
    configuration searches). ``rendezvous`` overrides the costs' send semantics.
    ``gpus_per_node`` groups ranks into nodes for shared memory (default: all on one node).
    """
    tab = (costs or UnitCosts()).table(schedule) if not isinstance(costs, CostTable) else costs
    rv = tab.rendezvous if rendezvous is None else rendezvous
    out = run_program(schedule, tab, rendezvous=rv, record=record, memory=memory)
    R = schedule.n_ranks
    it = out["iteration"]
    busy = out["busy"]
    bubble = [(it - b) / it if it > 0 else 0.0 for b in busy]
    ratio = (it * R - sum(busy)) / (it * R) if it > 0 else 0.0
    peaks = [0.0] * R
    cats = [[0.0] * R for _ in range(4)]
    if memory:
        for r in range(R):
            pk, cp = _peaks(out["mem"][r])
            peaks[r] = pk
            for k in range(4):
                cats[k][r] = cp[k]
    gpn = gpus_per_node or R
    host, shm = host_memory(schedule, tab, gpn)
    events: list[Event] = []
    if record:
        ops = schedule.ops
        prog = compile_schedule(schedule)
        for r, lane, i, st, en in out["events"]:
            if i < 0:  # async transfer: find the SEND op on the sender
                m = -1 - i
                st_, sub_, mb_ = prog.msg_op[m]
                op = Op(OpKind.SEND_CKPT, st_, sub_, mb_, prog.msg_dst[m], True)
            else:
                op = ops[r][i]
            events.append(Event(r, LANES[lane], op, st, en))
    return Timeline(schedule.name, R, it, busy, bubble, ratio, out["gpu_end"], peaks, cats[_P], cats[_G],
                    cats[_C], cats[_W], host, shm, gpn, tab.unit, events, schedule)

