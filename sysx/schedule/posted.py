"""Posted receives: a blocking activation or gradient receive that stands passes before its reader
becomes an irecv posted where it stood and a WAIT right before the pass that reads it.

Lowering places every receive at the logical time its message is produced, so a rank that reaches
it early blocks there until the sender has finished the producing pass and the transfer, although
the passes before the reader need nothing from it. In SysX that wait is paid once per micro-batch
(the prefetched input of a later stage, the ring's gradient of the next round): about one
transfer, 1-1.5% of the emulated Fig. 9 iteration. Posted, the transfer runs while the rank computes.

A receive that lowering put between two passes, the second its reader, is first moved one pass
earlier (:func:`look_ahead`): a transfer starts only once both sides have posted, so a receive
posted after the previous pass exposes the whole transfer before every pass of a chain (SysX's
backward rounds, GPipe's and 1F1B's steady state), 3% of a Fig. 9 iteration on the downstream
ranks. A receive with no pass before it on its rank, or whose previous pass is of the same
micro-batch (its message depends on that pass, so posting earlier gains nothing), is left blocking.
The sender's matching send is marked async too (both sides of a message name one mode); the
runtime posts every send as an isend either way.
"""

from __future__ import annotations

import dataclasses

from sysx.schedule.ops import RECVS, SEND_OF, WAIT_OF, Op, OpKind, Schedule

_PASSES = (OpKind.FORWARD, OpKind.BACKWARD)
_RECVS = (OpKind.RECV_ACT, OpKind.RECV_GRAD)


def reader(schedule: Schedule, op: Op) -> Op:
    """The pass that reads what the RECV_ACT / RECV_GRAD ``op`` brings: the next stage's forward,
    or the backward sub-stage just before the one whose input gradient it is."""
    if op.kind == OpKind.RECV_ACT:
        return Op(OpKind.FORWARD, op.stage + 1, -1, op.mb)
    if op.sub > 0:
        return Op(OpKind.BACKWARD, op.stage, op.sub - 1, op.mb)
    return Op(OpKind.BACKWARD, op.stage - 1, schedule.split - 1, op.mb)


def _next_pass(ops: list[Op], i: int) -> Op | None:
    return next((ops[j] for j in range(i + 1, len(ops)) if ops[j].kind in _PASSES), None)


def look_ahead(schedule: Schedule, ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """One rank's list with every blocking receive whose reader is the next pass moved before the
    pass before it, when that pass is of another micro-batch and no receive from the same peer is
    jumped over (a pair's messages keep their posting order)."""
    out = list(ops)
    prev = -1  # index in ``out`` of the last pass before ``i``
    for i in range(len(out)):
        op = out[i]
        if op.kind in _PASSES:
            prev = i
        elif (
            op.kind in _RECVS
            and not op.is_async
            and prev >= 0
            and out[prev].mb != op.mb
            and _next_pass(out, i) == reader(schedule, op)
            and not any(o.peer == op.peer and o.kind in RECVS for o in out[prev:i])
        ):
            out.insert(prev, out.pop(i))
            prev += 1
    return tuple(out)


def _posted_on(schedule: Schedule, ops: tuple[Op, ...]) -> dict[int, Op]:
    """Positions of the receives worth posting in one rank's list -> their reader."""
    at = {op: i for i, op in enumerate(ops) if op.kind in _PASSES}
    out = {}
    for i, op in enumerate(ops):
        if op.kind in _RECVS and not op.is_async:
            j = at.get(read := reader(schedule, op), -1)
            if j > i and any(ops[x].kind in _PASSES for x in range(i + 1, j)):
                out[i] = read
    return out


def post_receives(schedule: Schedule, *, ahead: bool = True) -> Schedule:
    """``schedule`` with its blocking activation and gradient receives moved one pass ahead where
    that helps (``ahead``) and the far-ahead ones posted (module doc); ``schedule`` itself when
    there are none."""
    moved = [look_ahead(schedule, ops) for ops in schedule.ops] if ahead else list(schedule.ops)
    if moved != list(schedule.ops):
        schedule = schedule.with_ops(moved)
    posted = [_posted_on(schedule, ops) for ops in schedule.ops]
    if not any(posted):
        return schedule
    senders: set[tuple[int, Op]] = set()  # (rank, the send to mark async)
    lists: list[list[Op]] = []
    for r, ops in enumerate(schedule.ops):
        waits = {}
        for i, read in posted[r].items():
            op = ops[i]
            waits[read] = Op(WAIT_OF[op.message[0]], op.stage, op.sub, op.mb, op.peer)
            senders.add((op.peer, Op(SEND_OF[op.message[0]], op.stage, op.sub, op.mb, r)))
        out: list[Op] = []
        for i, op in enumerate(ops):
            if op in waits:
                out.append(waits[op])
            out.append(dataclasses.replace(op, is_async=True) if i in posted[r] else op)
        lists.append(out)
    for r, out in enumerate(lists):
        lists[r] = [dataclasses.replace(op, is_async=True) if (r, op) in senders else op for op in out]
    return schedule.with_ops(lists)
