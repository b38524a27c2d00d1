"""Prove a schedule executable before any process starts: :func:`validate`.

Checks ranges, that every pass runs exactly once, that sends and receives pair up in the same order
on both ranks, each rank's dependencies (data, parameters, offloads, optimizer steps, VALIDATE) and
that the ranks together cannot deadlock; each error names the rank, the op index, the op and what
is missing.
"""

from __future__ import annotations

from collections.abc import Callable

from sysx.partition import unit_label
from sysx.schedule.costs import UnitCosts
from sysx.schedule.deadlock import Deadlock
from sysx.schedule.engine import run_program
from sysx.schedule.ops import (
    COMMS,
    PARTNER,
    RECV_OF,
    RECVS,
    SENDS,
    WAIT_OF,
    WAITS,
    B,
    F,
    Message,
    Op,
    OpKind,
    Schedule,
    ScheduleError,
    grad_producer,
)

# op kinds that only a training step has
_TRAINING_ONLY = frozenset(
    {
        OpKind.BACKWARD,
        OpKind.SEND_GRAD,
        OpKind.RECV_GRAD,
        OpKind.SEND_CKPT,
        OpKind.RECV_CKPT,
        OpKind.WAIT_CKPT,
        OpKind.WAIT_GRAD,
        OpKind.OFFLOAD_GRADS,
        OpKind.OPTIM_STEP,
        OpKind.VALIDATE,
    }
)
_NEEDS_SUB = frozenset(
    {
        OpKind.BACKWARD,
        OpKind.SEND_GRAD,
        OpKind.RECV_GRAD,
        OpKind.SEND_CKPT,
        OpKind.RECV_CKPT,
        OpKind.WAIT_CKPT,
        OpKind.WAIT_GRAD,
        OpKind.OFFLOAD_GRADS,
        OpKind.OPTIM_STEP,
    }
)


def _partner_str(op: Op, rank: int) -> str:
    return str(Op(PARTNER[op.kind], op.stage, op.sub, op.mb, rank, op.is_async))


def validate(schedule: Schedule, *, max_errors: int = 25) -> None:
    """Raise :class:`ScheduleError` listing every problem found (see docs/architecture.md); else return."""
    if len(schedule.ops) != schedule.n_ranks:
        raise ScheduleError(
            f"schedule {schedule.name!r} has {len(schedule.ops)} op lists for n_ranks={schedule.n_ranks}"
        )
    errors = check_ranges(schedule)
    if errors:
        _raise(schedule, errors, max_errors)
    errors = check_coverage(schedule) + check_pairing(schedule) + check_dependencies(schedule)
    errors += check_ckpt_plan(schedule)
    if errors:
        _raise(schedule, errors, max_errors)
    check_deadlock(schedule)


def check_ranges(schedule: Schedule) -> list[str]:
    """1. Every op's stage, sub-stage, micro-batch and peer exist."""
    errors = []
    R, nm, nsf, d = schedule.n_ranks, schedule.n_micro, schedule.n_stages, schedule.split
    nb = schedule.n_backward
    for r, ops in enumerate(schedule.ops):
        for i, op in enumerate(ops):
            bad = []
            k = op.kind
            if k != OpKind.VALIDATE and not 0 <= op.stage < nsf:
                bad.append(f"stage {op.stage} not in 0..{nsf - 1}")
            if k in _NEEDS_SUB and not 0 <= op.sub < d:
                bad.append(f"sub-stage {op.sub} not in 0..{d - 1}")
            if k in (OpKind.LOAD_PARAMS, OpKind.FREE) and not -1 <= op.sub < d:
                bad.append(f"sub-stage {op.sub} not in -1..{d - 1}")
            has_mb = k in (OpKind.FORWARD, OpKind.BACKWARD) or k in COMMS or k in WAITS
            # a backward's, and its gradient's, index counts the parts (ScheduleOptions.backward_parts)
            grad = (k in COMMS or k in WAITS) and op.message[0] == Message.GRAD
            top = nb if k == OpKind.BACKWARD or grad else nm
            if has_mb and not 0 <= op.mb < top:
                bad.append(f"micro-batch {op.mb} not in 0..{top - 1}")
            if (k in COMMS or k in WAITS) and not (0 <= op.peer < R and op.peer != r):
                bad.append(f"peer {op.peer} is not another rank in 0..{R - 1}")
            if bad:
                errors.append(f"rank {r} op #{i} `{op}`: " + ", ".join(bad))
    return errors


def check_coverage(schedule: Schedule) -> list[str]:
    """2. Every pass runs exactly once; a forward-only program holds no op of training."""
    errors = []
    training = schedule.options.training
    seen: dict[Op, list[tuple[int, int]]] = {}
    for r, ops in enumerate(schedule.ops):
        for i, op in enumerate(ops):
            if not training and op.kind in _TRAINING_ONLY:
                errors.append(f"rank {r} op #{i} `{op}`: a forward-only program has no {op.kind.name}")
            if op.kind == OpKind.FORWARD:
                seen.setdefault(F(op.stage, op.mb), []).append((r, i))
            elif op.kind == OpKind.BACKWARD:
                seen.setdefault(B(op.stage, op.sub, op.mb), []).append((r, i))
    parts = schedule.options.backward_parts
    for s in range(schedule.n_stages):
        for j in range(schedule.n_micro):
            passes = [F(s, j)]
            if training:
                passes += [B(s, k, j * parts + p) for k in range(schedule.split) for p in range(parts)]
            for key in passes:
                at = seen.get(key, [])
                if not at:
                    errors.append(f"`{key}` never runs on any rank")
                elif len(at) > 1:
                    where = ", ".join(f"rank {r} op #{i}" for r, i in at)
                    errors.append(f"`{key}` runs {len(at)} times ({where}); every pass must run exactly once")
    return errors


_Posted = dict[tuple, list[tuple[int, int, Op]]]


def _posted_messages(schedule: Schedule) -> tuple[_Posted, _Posted, dict[tuple[int, int, str], list]]:
    """Sends and receives by (message, src, dst), and each pair's sends / receives in posting order."""
    sends: _Posted = {}
    recvs: _Posted = {}
    order: dict[tuple[int, int, str], list[tuple[tuple, int, Op]]] = {}
    for r, ops in enumerate(schedule.ops):
        for i, op in enumerate(ops):
            if op.kind in SENDS:
                key = (op.message, r, op.peer)
                sends.setdefault(key, []).append((r, i, op))
                order.setdefault((r, op.peer, "s"), []).append((key, i, op))
            elif op.kind in RECVS:
                key = (op.message, op.peer, r)
                recvs.setdefault(key, []).append((r, i, op))
                order.setdefault((op.peer, r, "r"), []).append((key, i, op))
    return sends, recvs, order


def check_pairing(schedule: Schedule) -> list[str]:
    """3. Every send meets exactly one receive in the same mode, and each pair of ranks posts
    its messages in one order (checked only once every message is paired)."""
    errors: list[str] = []
    sends, recvs, order = _posted_messages(schedule)
    for mine, theirs, verb in ((sends, recvs, "sends"), (recvs, sends, "receives")):
        for key, lst in mine.items():
            r, i, op = lst[0]
            if len(lst) > 1:
                errors.append(
                    f"rank {r} {verb} `{op}` {len(lst)} times (ops " + ", ".join(f"#{x[1]}" for x in lst) + ")"
                )
            if key not in theirs:
                errors.append(f"rank {r} op #{i} `{op}` has no matching `{_partner_str(op, r)}` on rank {op.peer}")
            elif verb == "sends" and theirs[key][0][2].is_async != op.is_async:
                ro = theirs[key][0]
                errors.append(
                    f"rank {r} op #{i} `{op}` is matched by `{ro[2]}` (rank {ro[0]} op #{ro[1]}) in the other "
                    f"mode; post both sides sync or both async"
                )
    if errors:
        return errors
    for (a, b, side), lst in order.items():
        if side != "s":
            continue
        other = order.get((a, b, "r"), [])
        for n, ((ks, i_s, op_s), (kr, i_r, op_r)) in enumerate(zip(lst, other)):
            if ks != kr:
                errors.append(
                    f"ranks {a} and {b} post their messages in different orders: message {n} from rank {a} to "
                    f"rank {b} is `{op_s}` (rank {a} op #{i_s}) but rank {b}'s receive {n} from rank {a} is "
                    f"`{op_r}` (op #{i_r}); NCCL matches a pair's messages in posting order, so post them "
                    f"in the same order on both ranks"
                )
                break
    return errors


class _RankState:
    """What one rank has computed, received, loaded, offloaded and stepped so far (check 4)."""

    def __init__(self, schedule: Schedule, rank: int, offloaded: dict, stepped: dict) -> None:
        self.schedule, self.rank = schedule, rank
        self.offloaded, self.stepped = offloaded, stepped  # over all ranks: (s, k) -> rank
        self.done_f: set[tuple[int, int]] = set()
        self.done_b: set[tuple[int, int, int]] = set()
        self.got_act: set[tuple[int, int]] = set()
        self.got_grad: set[tuple[int, int, int]] = set()
        self.posted: set[tuple[Message, int, int, int]] = set()  # async receives not waited for yet
        self.ready_ck: set[tuple[int, int, int]] = set()
        self.resident: dict[tuple[int, int], range] = {}
        self.local_off: set[tuple[int, int]] = set()
        self.shards: list[tuple[tuple[int, int], int, str]] = []  # (unit, owner, where): shard steps
        self.validated = -1
        self.errors: list[str] = []
        self.checks: dict[OpKind, Callable[[Op, str], None]] = {
            OpKind.FORWARD: self._forward,
            OpKind.BACKWARD: self._backward,
            OpKind.SEND_ACT: self._send_act,
            OpKind.SEND_GRAD: self._send_grad,
            OpKind.SEND_CKPT: self._send_ckpt,
            OpKind.RECV_ACT: self._recv,
            OpKind.RECV_GRAD: self._recv,
            OpKind.RECV_CKPT: self._recv,
            OpKind.WAIT_ACT: self._wait,
            OpKind.WAIT_GRAD: self._wait,
            OpKind.WAIT_CKPT: self._wait,
            OpKind.LOAD_PARAMS: self._load,
            OpKind.FREE: self._free,
            OpKind.OFFLOAD_GRADS: self._offload,
            OpKind.OPTIM_STEP: self._optim_step,
        }

    def run(self, ops: tuple[Op, ...]) -> list[str]:
        """Check every op of the rank's list in order; then what the list must end with."""
        for i, op in enumerate(ops):
            here = f"rank {self.rank} op #{i} `{op}`"
            k = op.kind
            if self.validated >= 0 and not (k == OpKind.OPTIM_STEP and not op.is_async) and k != OpKind.FREE:
                self.errors.append(
                    f"{here} comes after VALIDATE (op #{self.validated}); only synchronous OPTIM_STEPs may follow it"
                )
            if k in (OpKind.FORWARD, OpKind.BACKWARD):
                self._params_loaded(op, here)
            if k == OpKind.VALIDATE:
                if self.validated >= 0:
                    self.errors.append(f"{here}: second VALIDATE on this rank (first at op #{self.validated})")
                self.validated = i
            else:
                self.checks[k](op, here)
        if self.validated < 0 and self.schedule.options.training:
            self.errors.append(
                f"rank {self.rank} never runs VALIDATE (the all-reduce of overflow flags every rank joins)"
            )
        if self.resident:
            self.errors.append(
                f"rank {self.rank} never frees "
                + ", ".join(unit_label(*u) for u in self.resident)
                + " (add FREE after the last use)"
            )
        return self.errors

    def _params_loaded(self, op: Op, here: str) -> None:
        need = self.schedule.partition.layers(op.stage, -1 if op.kind == OpKind.FORWARD else op.sub)
        if not any(u.start <= need.start and need.stop <= u.stop for u in self.resident.values()):
            self.errors.append(
                f"{here}: the parameters of layers {need.start}..{need.stop - 1} are not loaded "
                f"(no earlier LOAD_PARAMS covering them without a FREE since)"
            )

    def _forward(self, op: Op, here: str) -> None:
        prev = (op.stage - 1, op.mb)
        if op.stage > 0 and prev not in self.done_f and prev not in self.got_act:
            self.errors.append(
                f"{here}: its input (output of stage {op.stage - 1}, mb {op.mb}) was neither computed on "
                f"this rank nor received before ({self._missing(Message.ACT, op.stage - 1, -1, op.mb)})"
            )
        self.done_f.add((op.stage, op.mb))

    def _backward(self, op: Op, here: str) -> None:
        opts = self.schedule.options
        j = opts.whole(op.mb)
        ck = (op.stage, op.sub, j)
        if (op.stage, j) not in self.done_f and ck not in self.ready_ck:
            why = (
                "its async RECV_CKPT was posted but no WAIT_CKPT precedes it"
                if (Message.CKPT, *ck) in self.posted
                else f"no earlier `F s{op.stage} mb{j}` here and no RECV_CKPT"
            )
            self.errors.append(f"{here}: checkpoint of {unit_label(op.stage, op.sub)} mb{j} not available: {why}")
        first = op.mb - op.mb % opts.backward_parts
        if first != op.mb and (op.stage, op.sub, op.mb - 1) not in self.done_b:
            self.errors.append(
                f"{here}: runs before `{B(op.stage, op.sub, op.mb - 1)}` here; a micro-batch's backward "
                "parts run in order on one rank (its checkpoint is freed after the last)"
            )
        key = (op.stage, op.sub, op.mb)
        nxt = self.schedule.partition.next_sub(op.stage, op.sub)
        prod = grad_producer(op, self.schedule.partition, opts.head_igrad, opts.backward_parts)
        if nxt is not None and prod is not None and not self._computed(prod) and (*nxt, op.mb) not in self.got_grad:
            self.errors.append(
                f"{here}: its output gradient (from `{prod}`) was neither "
                f"computed on this rank nor received before ({self._missing(Message.GRAD, *nxt, op.mb)})"
            )
        self.done_b.add(key)

    def _computed(self, op: Op) -> bool:
        """Whether pass ``op`` ran on this rank already."""
        if op.kind == OpKind.FORWARD:
            return (op.stage, op.mb) in self.done_f
        return (op.stage, op.sub, op.mb) in self.done_b

    def _missing(self, family: Message, s: int, k: int, j: int) -> str:
        """Why a pass's input message is not here: posted but not waited for, or never received."""
        if (family, s, k, j) in self.posted:
            return f"its async {RECV_OF[family].name} was posted but no {WAIT_OF[family].name} precedes it"
        return f"missing `{RECV_OF[family].name} {unit_label(s, k)} mb{j}`"

    def _send_act(self, op: Op, here: str) -> None:
        if (op.stage, op.mb) not in self.done_f:
            self.errors.append(f"{here}: sends the output of `F s{op.stage} mb{op.mb}` before computing it here")

    def _send_grad(self, op: Op, here: str) -> None:
        opts = self.schedule.options
        last = self.schedule.partition.next_sub(op.stage, op.sub) is None
        j = opts.whole(op.mb)
        prod = F(op.stage, j) if last and j in opts.head_igrad else B(op.stage, op.sub, op.mb)
        if not self._computed(prod):
            self.errors.append(
                f"{here}: sends the input gradient of {unit_label(op.stage, op.sub)} mb{op.mb} before computing it here (`{prod}`)"
            )

    def _send_ckpt(self, op: Op, here: str) -> None:
        if (op.stage, op.mb) not in self.done_f:
            self.errors.append(f"{here}: sends a checkpoint of `F s{op.stage} mb{op.mb}` before computing it here")

    def _recv(self, op: Op, here: str) -> None:
        if op.is_async:
            self.posted.add(op.message)
        else:
            self._received(op)

    def _received(self, op: Op) -> None:
        """The message ``op`` receives or waits for is here, for its reader."""
        family = op.message[0]
        if family == Message.ACT:
            self.got_act.add((op.stage, op.mb))
        else:
            (self.got_grad if family == Message.GRAD else self.ready_ck).add((op.stage, op.sub, op.mb))

    def _wait(self, op: Op, here: str) -> None:
        family = op.message[0]
        if op.message not in self.posted:
            self.errors.append(
                f"{here}: waits for the {family.noun} whose async {RECV_OF[family].name} was not posted before"
            )
        self.posted.discard(op.message)
        self._received(op)

    def _load(self, op: Op, here: str) -> None:
        u = (op.stage, op.sub)
        if u in self.resident:
            self.errors.append(f"{here}: {unit_label(*u)} is already loaded (no FREE since the last LOAD_PARAMS)")
        self.resident[u] = self.schedule.partition.layers(op.stage, op.sub)

    def _free(self, op: Op, here: str) -> None:
        u = (op.stage, op.sub)
        if u not in self.resident:
            self.errors.append(f"{here}: frees {unit_label(*u)}, which is not loaded")
        self.resident.pop(u, None)

    def _offload(self, op: Op, here: str) -> None:
        g = (op.stage, op.sub)
        miss = [j for j in range(self.schedule.n_backward) if (op.stage, op.sub, j) not in self.done_b]
        if miss:
            self.errors.append(
                f"{here}: the backward of micro-batch(es) {miss} of {unit_label(*g)} did not run on "
                f"this rank before; a sub-stage's gradients must accumulate on one rank"
            )
        if g in self.offloaded:
            self.errors.append(f"{here}: {unit_label(*g)} is offloaded twice")
        self.offloaded[g] = self.rank
        self.local_off.add(g)

    def _optim_step(self, op: Op, here: str) -> None:
        g = (op.stage, op.sub)
        if op.peer >= 0:  # a shard of rank op.peer's step (sysx.schedule.spread)
            if not op.is_async:
                self.errors.append(f"{here}: a shard of another rank's step must be asynchronous")
            if op.peer == self.rank:
                self.errors.append(f"{here}: a rank steps a shard of its own sub-stage {unit_label(*g)}")
            self.shards.append((g, op.peer, here))
            return
        if g not in self.local_off:
            self.errors.append(f"{here}: steps {unit_label(*g)} before its OFFLOAD_GRADS on this rank")
        if not op.is_async and self.validated < 0:
            self.errors.append(f"{here}: a synchronous optimizer step must follow VALIDATE (the overflow check)")
        if g in self.stepped:
            self.errors.append(f"{here}: {unit_label(*g)} is stepped twice")
        self.stepped[g] = self.rank


def check_dependencies(schedule: Schedule) -> list[str]:
    """4. Per rank: inputs, checkpoints, gradients and parameters are there when used; every
    sub-stage of a training step is offloaded and stepped once."""
    errors: list[str] = []
    offloaded: dict[tuple[int, int], int] = {}
    stepped: dict[tuple[int, int], int] = {}
    shards: list[tuple[tuple[int, int], int, str]] = []
    for r, ops in enumerate(schedule.ops):
        state = _RankState(schedule, r, offloaded, stepped)
        errors += state.run(ops)
        shards += state.shards
    for g, owner, here in shards:  # its owner's step shared: the owner offloads and steps it too
        if offloaded.get(g) != owner or stepped.get(g) != owner:
            errors.append(
                f"{here}: steps a shard of {unit_label(*g)} for rank {owner}, which does not offload and step it"
            )
    if schedule.options.training:
        for s in range(schedule.n_stages):
            for k in range(schedule.split):
                if (s, k) not in offloaded:
                    errors.append(f"OFFLOAD_GRADS s{s}.{k} is missing (after its last backward)")
                if (s, k) not in stepped:
                    errors.append(f"OPTIM_STEP s{s}.{k} is missing")
    return errors


def check_ckpt_plan(schedule: Schedule) -> list[str]:
    """Every checkpoint route between ranks points at its SEND_CKPT and RECV_CKPT."""
    errors = []
    for rt in schedule.ckpt_plan:
        if rt.mode == "local":
            continue
        for rank, idx, kind in ((rt.src, rt.src_index, OpKind.SEND_CKPT), (rt.dst, rt.dst_index, OpKind.RECV_CKPT)):
            ops = schedule.ops[rank] if 0 <= rank < schedule.n_ranks else ()
            op = ops[idx] if 0 <= idx < len(ops) else None
            if op is None or op.kind != kind or (op.stage, op.sub, op.mb) != (rt.stage, rt.sub, rt.mb):
                errors.append(
                    f"checkpoint plan entry s{rt.stage}.{rt.sub} mb{rt.mb} ({rt.src}->{rt.dst}) points at "
                    f"rank {rank} op #{idx} `{op}`, not a {kind.name} of that checkpoint"
                )
    return errors


def check_deadlock(schedule: Schedule) -> None:
    """5. Execute all ranks together with blocking semantics; a deadlock is a :class:`ScheduleError`."""
    try:
        run_program(schedule, UnitCosts(0.0, 0.0, 0.0).table(schedule), rendezvous=True, record=False, memory=False)
    except Deadlock as err:
        raise ScheduleError(str(err)) from None


def _raise(schedule: Schedule, errors: list[str], max_errors: int) -> None:
    shown = errors[:max_errors]
    more = f"\n  ... and {len(errors) - max_errors} more" if len(errors) > max_errors else ""
    raise ScheduleError(
        f"schedule {schedule.name!r} is invalid ({len(errors)} problem(s)):\n  - " + "\n  - ".join(shown) + more
    )
