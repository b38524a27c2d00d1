"""The discrete-event engine behind :func:`~sysx.schedule.simulate.simulate` and the validator's
deadlock check: the op lists compiled to integer instructions, executed on all ranks at once.

The op semantics and timing rules are those described in :mod:`sysx.schedule.simulate`. A rank
runs until an instruction blocks (a receive whose data is not there, a rendezvous send whose
receive is not posted, a WAIT_CKPT, the VALIDATE barrier); a message that arrives wakes its
waiters. Ranks left unfinished when nothing can run any more are a :class:`Deadlock`.
"""

from __future__ import annotations

import heapq
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sysx.schedule.costs import CostTable
from sysx.schedule.deadlock import deadlock_report
from sysx.schedule.ops import MESSAGE_OF, RECV_OF, SEND_OF, WAITS, Message, Op, OpKind, Schedule
from sysx.schedule.param_pool import place_loads
from sysx.schedule.spread import spread_shares

GPU, H2D, D2H, P2P, CPU, REDUCE = ("gpu", "h2d", "d2h", "p2p", "cpu", "reduce")
(_LOAD, _FREE, _FWD, _BWD, _SEND, _RECV, _ASEND, _ARECV, _WAIT, _OFFL, _OPTA, _OPTS, _VAL) = range(13)
PARAMS, GRADS, CKPTS, WORK = range(4)  # memory categories: params, grads, checkpoints, working activations


@dataclass
class Program:
    """A schedule in integer form: per rank, instructions ``(opcode, operand, ..., op index)``;
    per message id, its sender, receiver, kind and cost index; per async message, the SEND op
    that names its transfer on the timeline."""

    code: list[list[tuple]]
    msg_src: list[int]
    msg_dst: list[int]
    msg_kind: list[Message]
    msg_idx: list[int]
    transfer_op: dict[int, Op]
    n_units: int
    loads: list[list[tuple[bool, int]]]  # per rank, (is_load, unit) of its LOAD_PARAMS / FREE: the pool's plan
    shares: dict[int, int] = field(default_factory=dict)  # unit -> ranks sharing its step (spread)
    parts: int = 1  # ScheduleOptions.backward_parts: a backward and a gradient message cost 1/parts


def _unit_index(op: Op, nsf: int, d: int) -> int:
    return op.stage if op.sub < 0 else nsf + op.stage * d + op.sub


class _Compiler:
    """Numbers messages (one id per (kind, stage, sub, mb, src, dst)) and translates ops."""

    def __init__(self, schedule: Schedule) -> None:
        self.partition = schedule.partition
        self.nsf, self.d = self.partition.n_stages, self.partition.split
        self.head_igrad = schedule.options.head_igrad
        self.parts = schedule.options.backward_parts
        self.ids: dict[tuple, int] = {}
        self.src: list[int] = []
        self.dst: list[int] = []
        self.kind: list[Message] = []
        self.idx: list[int] = []
        self.transfer: dict[int, Op] = {}

    def message(self, op: Op, rank: int, sending: bool) -> int:
        a, b = (rank, op.peer) if sending else (op.peer, rank)
        kind = op.message[0]
        key = (kind, op.stage, op.sub, op.mb, a, b)
        m = self.ids.get(key)
        if m is None:
            m = self.ids[key] = len(self.src)
            self.src.append(a)
            self.dst.append(b)
            self.kind.append(kind)
            self.idx.append(op.stage if kind == Message.ACT else op.stage * self.d + op.sub)
        if sending:  # names the transfer on the timeline when it runs apart from its send (posted sends)
            self.transfer.setdefault(m, op)
        return m

    def async_message(self, op: Op, rank: int, sending: bool) -> int:
        """A message posted with isend/irecv; its transfer is drawn as the sender's async send."""
        m = self.message(op, rank, sending)
        if m not in self.transfer:
            self.transfer[m] = Op(SEND_OF[self.kind[m]], op.stage, op.sub, op.mb, self.dst[m], True)
        return m

    def rank(self, r: int, ops: tuple[Op, ...]) -> list[tuple]:
        p, nsf, d = self.partition, self.nsf, self.d
        head_igrad, parts = self.head_igrad, self.parts
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
                u = next((x[0] for x in reversed(resident) if x[1].start <= lay.start and lay.stop <= x[1].stop), -1)
                # the Head's input gradient on its forward
                moved = op.mb // (1 if k == OpKind.FORWARD else parts) in head_igrad and op.stage == nsf - 1
                if k == OpKind.FORWARD:
                    prog.append((_FWD, op.stage, u, i, moved))
                else:
                    g = op.stage * d + op.sub
                    # the checkpoint goes with the micro-batch's last part
                    prog.append((_BWD, g, u, i, g not in seen_g, moved, op.mb % parts == parts - 1))
                    seen_g.add(g)
            elif k in (OpKind.SEND_ACT, OpKind.SEND_GRAD, OpKind.SEND_CKPT):
                prog.append(
                    (_ASEND, self.async_message(op, r, True), i)
                    if op.is_async
                    else (_SEND, self.message(op, r, True), i)
                )
            elif k in (OpKind.RECV_ACT, OpKind.RECV_GRAD, OpKind.RECV_CKPT):
                prog.append(
                    (_ARECV, self.async_message(op, r, False), i)
                    if op.is_async
                    else (_RECV, self.message(op, r, False), i)
                )
            elif k in WAITS:
                recv = Op(RECV_OF[MESSAGE_OF[k]], op.stage, op.sub, op.mb, op.peer)
                prog.append((_WAIT, self.message(recv, r, False), i))
            elif k == OpKind.OFFLOAD_GRADS:
                prog.append((_OFFL, op.stage * d + op.sub, i))
            elif k == OpKind.OPTIM_STEP:
                prog.append((_OPTA if op.is_async else _OPTS, op.stage * d + op.sub, i))
            elif k == OpKind.VALIDATE:
                prog.append((_VAL, 0, i))
        return prog


def compile_schedule(schedule: Schedule) -> Program:
    """Integer form of the op lists."""
    c = _Compiler(schedule)
    code = [c.rank(r, ops) for r, ops in enumerate(schedule.ops)]
    loads = [[(ins[0] == _LOAD, ins[1]) for ins in rank if ins[0] in (_LOAD, _FREE)] for rank in code]
    shares = {s * c.d + k: n for (s, k), n in spread_shares(schedule).items()}
    return Program(code, c.src, c.dst, c.kind, c.idx, c.transfer, c.nsf + c.nsf * c.d, loads, shares, c.parts)


class ProgramCache:
    """Compiled programs of live schedules, by identity. Compiling costs more than a small run,
    and one schedule is run many times (validated, then simulated under many cost tables in a
    configuration search); an entry goes when its schedule is garbage-collected."""

    def __init__(self) -> None:
        self._programs: dict[int, Program] = {}

    def get(self, schedule: Schedule) -> Program:
        """The program of ``schedule``, compiled on first use."""
        key = id(schedule)
        prog = self._programs.get(key)
        if prog is None:
            prog = self._programs[key] = compile_schedule(schedule)
            weakref.finalize(schedule, self._programs.pop, key, None)
        return prog

    def __len__(self) -> int:
        return len(self._programs)


PROGRAMS = ProgramCache()


def op_index(ins: tuple) -> int:
    """Position in the rank's op list of the op an instruction came from."""
    return ins[3] if ins[0] in (_FWD, _BWD) else ins[-1]


class _Engine:
    """State of one run: per-rank cursors and streams, per-message posting and arrival times.

    A handler runs per instruction, tens of thousands of times per run: the state and the cost
    table's lists live in slots and plain lists, and memory deltas go straight into per-rank,
    per-category lists of ``(time, delta)``. Records hold numbers and lane names only (an op is
    named by its index), tuples the garbage collector stops tracking at its first pass.
    """

    __slots__ = (
        "allreduce",
        "arrival",
        "arrived",
        "asend_end",
        "blocked_on",
        "busy",
        "bwd",
        "bwd_work",
        "ckmem",
        "ckpt_mem",
        "clock",
        "code",
        "cpu_end",
        "d2h",
        "events",
        "f_ckpt",
        "fwd",
        "fwd_work",
        "gpu_end",
        "grad_mem",
        "h2d",
        "head_igrad",
        "heaps",
        "inq",
        "load",
        "mem",
        "memory",
        "msg_src",
        "offl_end",
        "offload",
        "op_host",
        "opt",
        "param_mem",
        "param_pool",
        "parts",
        "pcs",
        "posted",
        "queue",
        "record",
        "recv_post",
        "red_free",
        "reduce",
        "rendezvous",
        "send_post",
        "shares",
        "unit_ready",
        "val_time",
        "val_wait",
        "waiters",
        "workers",
        "xfer",
    )

    def __init__(
        self, prog: Program, tab: CostTable, *, rendezvous: bool, record: bool, memory: bool, posted: bool = False
    ) -> None:
        R, M = len(prog.code), len(prog.msg_src)
        self.code, self.msg_src = prog.code, prog.msg_src
        self.rendezvous, self.posted, self.record, self.memory = rendezvous, posted, record, memory
        xfers = (tab.act_xfer, tab.grad_xfer, tab.ckpt_xfer)
        self.parts = prog.parts  # a gradient message carries a part's rows: 1/parts of the table's
        per = [1.0, 1.0 / prog.parts, 1.0]
        self.xfer = [xfers[f][i] * per[f] for f, i in zip(prog.msg_kind, prog.msg_idx)]
        self.fwd, self.bwd, self.opt, self.offload = tab.fwd, tab.bwd, tab.opt, tab.offload
        self.shares = prog.shares
        if self.shares:  # each rank sharing a unit's step steps its share of it
            self.opt = [c / self.shares.get(g, 1) for g, c in enumerate(tab.opt)]
        self.load = list(tab.load_stage) + list(tab.load_sub)
        self.workers, self.allreduce = tab.optim_workers, tab.allreduce
        self.op_host = tab.op_host
        self.head_igrad = tab.head_igrad
        self.reduce = tab.reduce or None  # replicas: each unit's reduction on the rank's reducer thread
        self.red_free = [0.0] * R
        self._memory_tables(prog, tab)
        self.pcs = [0] * R
        self.clock = [0.0] * R
        self.busy = [0.0] * R
        self.gpu_end = [0.0] * R
        self.h2d = [0.0] * R
        self.d2h = [0.0] * R
        self.cpu_end = [0.0] * R
        self.asend_end = [0.0] * R
        self.unit_ready = [[0.0] * prog.n_units for _ in range(R)]
        self.offl_end: dict[int, float] = {}
        self.heaps: list[list[float]] = [[] for _ in range(R)]
        self.send_post: list[float | None] = [None] * M
        self.recv_post: list[float | None] = [None] * M
        self.arrival: list[float | None] = [None] * M
        self.waiters: dict[int, list[int]] = {}  # few messages are ever waited for
        # the parameter pool is allocated once, before the first op (sysx.schedule.param_pool)
        self.mem: list[tuple[list, ...]] = [([(0.0, pool)] if pool else [], [], [], []) for pool in self.param_pool]
        self.events: list[tuple] = []
        self.arrived: list[int] = []
        self.val_time: float | None = None
        self.val_wait: list[int] = []
        self.blocked_on: list[str] = [""] * R
        self.queue = deque(range(R))
        self.inq = [True] * R

    def _memory_tables(self, prog: Program, tab: CostTable) -> None:
        M = len(prog.msg_src)
        if not self.memory:
            self.ckmem = [0.0] * M
            self.param_pool = [0.0] * len(prog.code)
            return
        nsf, d = len(tab.fwd), tab.split
        self.ckmem = [tab.ckpt_mem[i] if f == Message.CKPT else 0.0 for f, i in zip(prog.msg_kind, prog.msg_idx)]
        self.param_mem = list(tab.param_stage) + list(tab.param_sub)
        mem = self.param_mem
        self.param_pool = [place_loads([(load, u, mem[u]) for load, u in rank]).size for rank in prog.loads]
        self.grad_mem, self.ckpt_mem = tab.grad_mem, tab.ckpt_mem
        self.fwd_work, self.bwd_work = tab.fwd_work, tab.bwd_work
        self.f_ckpt = [sum(tab.ckpt_mem[s * d + k] for k in range(d)) for s in range(nsf)]

    def run(self) -> None:
        """Advance ranks until every list is done or every unfinished rank is blocked."""
        code, pcs, clock, queue, inq = self.code, self.pcs, self.clock, self.queue, self.inq
        # by opcode; each returns the rank's new time, or None when the instruction blocks. Bound
        # here, not in __init__: kept on the engine, they would make it a reference cycle that only
        # the garbage collector frees (and all its lists with it)
        handlers: tuple[Callable[[int, tuple, float], float | None], ...] = (self._load, self._free, self._forward)
        handlers += (self._backward, self._send, self._recv, self._isend, self._irecv, self._wait, self._offload)
        handlers += (self._optim_async, self._optim_sync, self._validate)
        host = self.op_host
        while queue:
            r = queue.popleft()
            inq[r] = False
            ops = code[r]
            n = len(ops)
            pc, t = pcs[r], clock[r]
            while pc < n:
                ins = ops[pc]
                # the executor's cost per instruction precedes it (a blocked one, retried, pays it again from the same clock)
                nt = handlers[ins[0]](r, ins, t + host)
                if nt is None:
                    break
                t = nt
                pc += 1
            pcs[r] = pc
            clock[r] = t

    def _wake(self, m: int) -> None:
        """Queue the ranks blocked on message ``m`` (callers check ``m in self.waiters`` first)."""
        inq, queue = self.inq, self.queue
        for x in self.waiters.pop(m):
            if not inq[x]:
                inq[x] = True
                queue.append(x)

    def _block(self, r: int, m: int, why: str) -> None:
        self.waiters.setdefault(m, []).append(r)
        self.blocked_on[r] = why

    def _gpu_start(self, r: int, u: int, t: float) -> float:
        """When a pass the cursor reaches at ``t`` starts: once its unit ``u`` (if any) is loaded."""
        ready = self.unit_ready[r][u] if u >= 0 else t
        return t if t >= ready else ready

    def _forward(self, r: int, ins: tuple, t: float) -> float:
        s = ins[1]
        st = self._gpu_start(r, ins[2], t)
        en = st + self.fwd[s] + (self.head_igrad if ins[4] else 0.0)
        self.busy[r] += en - st
        self.gpu_end[r] = en
        if self.memory:
            mem = self.mem[r]
            # the Head's input gradient: its backward's temporaries (the logits' gradient) live here
            w = self.fwd_work[s] + (self.bwd_work[-1] if ins[4] else 0.0)
            if w:  # zero in unit-cost models; a zero delta never moves a peak
                mem[WORK].extend(((st, w), (en, -w)))
            mem[CKPTS].append((en, self.f_ckpt[s]))
        if self.record:
            self.events.append((r, GPU, ins[3], st, en))
        return en

    def _backward(self, r: int, ins: tuple, t: float) -> float:
        g = ins[1]
        st = self._gpu_start(r, ins[2], t)
        en = st + (self.bwd[g] - (self.head_igrad if ins[5] else 0.0)) / self.parts
        self.busy[r] += en - st
        self.gpu_end[r] = en
        if self.memory:
            mem = self.mem[r]
            if ins[4]:  # first backward of the sub-stage: its gradient buffer appears
                mem[GRADS].append((st, self.grad_mem[g]))
            w = self.bwd_work[g] / self.parts
            if w:
                mem[WORK].extend(((st, w), (en, -w)))
            if ins[6]:
                mem[CKPTS].append((en, -self.ckpt_mem[g]))
        if self.record:
            self.events.append((r, GPU, ins[3], st, en))
        return en

    def _send(self, r: int, ins: tuple, t: float) -> float | None:
        if self.posted:  # posted like an isend: the transfer runs once the receive is posted too
            return self._isend(r, ins, t)
        m = ins[1]
        st = t
        if self.rendezvous:
            rp = self.recv_post[m]
            if rp is None:
                self._block(r, m, "recv")
                return None
            st = t if t >= rp else rp
        en = st + self.xfer[m]
        self.arrival[m] = en
        if m in self.waiters:
            self._wake(m)
        if self.memory and self.ckmem[m]:
            self.mem[r][CKPTS].append((en, -self.ckmem[m]))
        if self.record:
            self.events.append((r, P2P, ins[2], st, en))
        return en

    def _recv(self, r: int, ins: tuple, t: float) -> float | None:
        m = ins[1]
        if self.posted:  # against posted sends: post, then wait for the transfer
            if self.recv_post[m] is None:
                self._irecv(r, ins, t)
            return self._wait(r, ins, t)
        if self.recv_post[m] is None:
            self.recv_post[m] = t
            if m in self.waiters:
                self._wake(m)
        a = self.arrival[m]
        if a is None:
            self._block(r, m, "send")
            return None
        t = a if a > t else t
        if self.memory and self.ckmem[m]:
            self.mem[r][CKPTS].append((t, self.ckmem[m]))
        return t

    def _load(self, r: int, ins: tuple, t: float) -> float:
        u = ins[1]
        free = self.h2d[r]
        st = t if t >= free else free
        en = st + self.load[u]
        self.h2d[r] = self.unit_ready[r][u] = en
        if self.record:
            self.events.append((r, H2D, ins[2], st, en))
        return t

    def _free(self, r: int, ins: tuple, t: float) -> float:
        return t

    def _isend(self, r: int, ins: tuple, t: float) -> float:
        """Post an isend; the transfer starts once the receive is posted too."""
        m = ins[1]
        self.send_post[m] = t
        other = self.recv_post[m]
        if other is not None:
            self._transfer(m, t, other)
        return t

    def _irecv(self, r: int, ins: tuple, t: float) -> float:
        """Post an irecv (its checkpoint buffer appears now); the transfer starts once the send is posted too."""
        m = ins[1]
        self.recv_post[m] = t
        if self.memory and self.ckmem[m]:
            self.mem[r][CKPTS].append((t, self.ckmem[m]))
        other = self.send_post[m]
        if other is not None:
            self._transfer(m, t, other)
        return t

    def _transfer(self, m: int, t: float, other: float) -> None:
        """Async message ``m`` moves from when both sides have posted (``t``: the later post's rank time)."""
        st = t if t >= other else other
        en = st + self.xfer[m]
        self.arrival[m] = en
        sr = self.msg_src[m]
        if en > self.asend_end[sr]:
            self.asend_end[sr] = en
        if self.memory and self.ckmem[m]:
            self.mem[sr][CKPTS].append((en, -self.ckmem[m]))
        if self.record:
            self.events.append((sr, P2P, ~m, st, en))
        if m in self.waiters:
            self._wake(m)

    def _wait(self, r: int, ins: tuple, t: float) -> float | None:
        m = ins[1]
        a = self.arrival[m]
        if a is None:
            self._block(r, m, "ckpt")
            return None
        return a if a > t else t

    def _offload(self, r: int, ins: tuple, t: float) -> float:
        g = ins[1]
        free = self.d2h[r]
        st = t if t >= free else free
        en = st + self.offload[g]
        self.d2h[r] = self.offl_end[g] = en
        if ~g in self.waiters:  # ranks sharing its step (sysx.schedule.spread)
            self._wake(~g)
        if self.memory:
            self.mem[r][GRADS].append((en, -self.grad_mem[g]))
        if self.record:
            self.events.append((r, D2H, ins[2], st, en))
        if self.reduce is not None:
            self._reduce(r, ins, en, self.reduce[g])
        return t

    def _reduce(self, r: int, ins: tuple, offloaded: float, seconds: float) -> None:
        """Replicas: the unit's gradients are reduced among its peers on the rank's reducer thread
        (units in offload order, each after its offload); its optimizer step waits for the end."""
        g = ins[1]
        free = self.red_free[r]
        st = offloaded if offloaded >= free else free
        en = st + seconds
        self.red_free[r] = self.offl_end[g] = en
        if self.record:
            self.events.append((r, REDUCE, ins[2], st, en))

    def _optim_async(self, r: int, ins: tuple, t: float) -> float | None:
        """On one of the rank's ``optim_workers`` CPU workers, from the end of the offload."""
        g = ins[1]
        workers = self.workers
        st = self.offl_end.get(g)
        if st is None:
            if g in self.shares:  # a shard of another rank's step: its offload is not home yet
                self._block(r, ~g, "offload")
                return None
            st = t
        if workers is not None:
            hp = self.heaps[r]
            if len(hp) >= workers:
                free = heapq.heappop(hp)
                st = st if st >= free else free
        en = st + self.opt[g]
        if workers is not None:
            heapq.heappush(self.heaps[r], en)
        self._cpu_done(r, ins, st, en)
        return t

    def _optim_sync(self, r: int, ins: tuple, t: float) -> float:
        g = ins[1]
        ready = self.offl_end.get(g, t)
        st = t if t >= ready else ready
        en = st + self.opt[g]
        self._cpu_done(r, ins, st, en)
        return en

    def _cpu_done(self, r: int, ins: tuple, st: float, en: float) -> None:
        if en > self.cpu_end[r]:
            self.cpu_end[r] = en
        if self.record:
            self.events.append((r, CPU, ins[2], st, en))

    def _validate(self, r: int, ins: tuple, t: float) -> float | None:
        """A barrier: ends when every rank has arrived and its copies, sends and steps are done."""
        if self.val_time is None:
            if r not in self.arrived:
                self.arrived.append(r)
                self.clock[r] = t
            R = len(self.clock)
            if len(self.arrived) < R:
                self.val_wait.append(r)
                self.blocked_on[r] = "validate"
                return None
            top = max(
                max(self.clock[x], self.d2h[x], self.cpu_end[x], self.asend_end[x], self.red_free[x]) for x in range(R)
            )
            self.val_time = max(top, 0.0) + self.allreduce
            for x in self.val_wait:
                if not self.inq[x]:
                    self.inq[x] = True
                    self.queue.append(x)
            self.val_wait.clear()
        return self.val_time


def run_program(
    schedule: Schedule, tab: CostTable, *, rendezvous: bool, record: bool, memory: bool, posted: bool = False
) -> dict:
    """Execute every rank's list together; returns iteration time, per-rank busy time, GPU end,
    memory deltas (per rank, per category: ``(time, delta)`` lists), events ``(rank, lane, op
    index, start, end)`` (index ``~m`` for the async transfer of message ``m``), clocks and each
    rank's end (its list, copies and optimizer steps done). Raises :class:`Deadlock` when ranks wait for each other."""
    prog = PROGRAMS.get(schedule)
    eng = _Engine(prog, tab, rendezvous=rendezvous, record=record, memory=memory, posted=posted)
    eng.run()
    if any(eng.pcs[r] < len(prog.code[r]) for r in range(len(prog.code))):
        current = [op_index(code[pc]) if pc < len(code) else None for code, pc in zip(prog.code, eng.pcs, strict=True)]
        raise deadlock_report(schedule, current, eng.pcs, eng.blocked_on)
    iteration = max(max(eng.clock), max(eng.cpu_end), max(eng.d2h), max(eng.h2d)) if prog.code else 0.0
    return {
        "iteration": iteration,
        "busy": eng.busy,
        "gpu_end": eng.gpu_end,
        "mem": eng.mem,
        "events": eng.events,
        "clock": eng.clock,
        "rank_end": [max(eng.clock[r], eng.cpu_end[r], eng.d2h[r], eng.h2d[r]) for r in range(len(prog.code))],
    }
