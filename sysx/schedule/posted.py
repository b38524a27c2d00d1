"""Posted receives: a blocking activation or gradient receive that stands passes before its reader
becomes an irecv posted where it stood and a WAIT right before the pass that reads it.

Lowering places every receive at the logical time its message is produced, so a rank that reaches
it early blocks there until the sender has finished the producing pass and the transfer, although
the passes before the reader need nothing from it. In SysX that wait is paid once per micro-batch
(the prefetched input of a later stage, the ring's gradient of the next round): about one
transfer, 1-1.5% of the emulated Fig. 9 iteration. Posted, the transfer runs while the rank computes.
A receive right before its reader (no pass between) is left blocking: posting it gains nothing and
adds an op. The sender's matching send is marked async too (both sides of a message name one
mode); the runtime posts every send as an isend either way.
"""

from __future__ import annotations

import dataclasses

from sysx.schedule.ops import SEND_OF, WAIT_OF, Op, OpKind, Schedule

_PASSES = (OpKind.FORWARD, OpKind.BACKWARD)


def reader(schedule: Schedule, op: Op) -> Op:
    """The pass that reads what the RECV_ACT / RECV_GRAD ``op`` brings: the next stage's forward,
    or the backward sub-stage just before the one whose input gradient it is."""
    if op.kind == OpKind.RECV_ACT:
        return Op(OpKind.FORWARD, op.stage + 1, -1, op.mb)
    if op.sub > 0:
        return Op(OpKind.BACKWARD, op.stage, op.sub - 1, op.mb)
    return Op(OpKind.BACKWARD, op.stage - 1, schedule.split - 1, op.mb)


def _posted_on(schedule: Schedule, ops: tuple[Op, ...]) -> dict[int, Op]:
    """Positions of the receives worth posting in one rank's list -> their reader."""
    at = {op: i for i, op in enumerate(ops) if op.kind in _PASSES}
    out = {}
    for i, op in enumerate(ops):
        if op.kind in (OpKind.RECV_ACT, OpKind.RECV_GRAD) and not op.is_async:
            j = at.get(read := reader(schedule, op), -1)
            if j > i and any(ops[x].kind in _PASSES for x in range(i + 1, j)):
                out[i] = read
    return out


def post_receives(schedule: Schedule) -> Schedule:
    """``schedule`` with its far-ahead blocking activation and gradient receives posted (module doc);
    ``schedule`` itself when there are none."""
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
