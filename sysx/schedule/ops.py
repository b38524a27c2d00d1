"""Schedules as data: the :class:`Op` instruction, the checkpoint route and the :class:`Schedule`.

A schedule is, for every rank, an ordered list of ops; the runtime interprets each rank's list
unchanged, in order, and ``validate`` / ``simulate`` read the very same lists.

Op semantics (what the interpreter does; ``s`` stage, ``k`` sub-stage, ``j`` micro-batch):

- ``LOAD_PARAMS s`` / ``LOAD_PARAMS s.k``: start the host->GPU copy of the parameters of forward
  stage ``s`` (``sub == -1``) or backward sub-stage ``(s, k)`` into a free stage buffer, on the
  H2D stream, without waiting. A FORWARD/BACKWARD whose layers lie in a loaded unit waits for
  that copy (an event) before it computes. ``FREE`` returns the buffer once the compute stream
  is done with it.
- ``FORWARD s j``: forward of stage ``s`` on micro-batch ``j`` without autograd; keeps the
  checkpoints of the sub-stages of ``s`` that this rank's ``BACKWARD`` needs or that a later
  ``SEND_CKPT`` sends (checkpoint of ``(s, k)`` = input of its first layer).
- ``BACKWARD s.k j``: recompute sub-stage ``(s, k)`` from its checkpoint, backpropagate the
  output gradient (the loss for the model's last sub-stage), accumulate parameter gradients.
- ``SEND_ACT s j -> p`` / ``RECV_ACT s j <- p``: the output of forward stage ``s`` (input of
  ``s + 1``); synchronous. ``SEND_GRAD s.k j`` / ``RECV_GRAD s.k j``: the gradient w.r.t. the
  input of sub-stage ``(s, k)`` (the output gradient of the previous sub-stage); synchronous.
- ``SEND_CKPT s.k j`` / ``RECV_CKPT s.k j``: the checkpoint of ``(s, k)``. ``is_async``: post
  ``isend`` / ``irecv`` and go on; a ``WAIT_CKPT s.k j`` on the receiver waits for the handle
  right before the backward needs it. The sender keeps the buffer until its handle completes
  (poll it; wait for all of them at ``VALIDATE``). Synchronous when not ``is_async``.
- ``OFFLOAD_GRADS s.k``: after the last micro-batch of ``(s, k)``: copy the accumulated
  gradients GPU->host on the D2H stream (record an event); the gradient buffer is freed then.
- ``OPTIM_STEP s.k``: CPU optimizer step of ``(s, k)``. ``is_async``: hand it to the sub-stage's
  CPU thread, which waits for the offload event, checks for inf/nan and steps at once (SysX).
  Synchronous: step now, after ``VALIDATE`` (baselines).
- ``VALIDATE``: wait for this rank's offloads, async sends and optimizer threads, then one
  all-reduce over all ranks of the overflow flags (and squared gradient norms); async
  optimizers roll back when any rank overflowed.

Ops are hashable frozen dataclasses whose ``str`` reads like ``F s3 mb2`` or ``B s5.1 mb0``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sysx.partition import Partition, Placement


class ScheduleError(ValueError):
    """A schedule that is impossible to build or that failed validation."""


class OpKind(enum.IntEnum):
    """What an op does (see the module docstring)."""

    LOAD_PARAMS = 0
    FREE = 1
    FORWARD = 2
    BACKWARD = 3
    SEND_ACT = 4
    RECV_ACT = 5
    SEND_GRAD = 6
    RECV_GRAD = 7
    SEND_CKPT = 8
    RECV_CKPT = 9
    WAIT_CKPT = 10
    OFFLOAD_GRADS = 11
    OPTIM_STEP = 12
    VALIDATE = 13


SENDS = frozenset({OpKind.SEND_ACT, OpKind.SEND_GRAD, OpKind.SEND_CKPT})
RECVS = frozenset({OpKind.RECV_ACT, OpKind.RECV_GRAD, OpKind.RECV_CKPT})
COMMS = SENDS | RECVS
PARTNER = {
    OpKind.SEND_ACT: OpKind.RECV_ACT, OpKind.RECV_ACT: OpKind.SEND_ACT,
    OpKind.SEND_GRAD: OpKind.RECV_GRAD, OpKind.RECV_GRAD: OpKind.SEND_GRAD,
    OpKind.SEND_CKPT: OpKind.RECV_CKPT, OpKind.RECV_CKPT: OpKind.SEND_CKPT,
}
_SHORT = {OpKind.FORWARD: "F", OpKind.BACKWARD: "B", OpKind.LOAD_PARAMS: "LOAD", OpKind.OFFLOAD_GRADS: "OFFLOAD",
          OpKind.OPTIM_STEP: "OPT"}


@dataclass(frozen=True, slots=True)
class Op:
    """One instruction of one rank's list. Unused fields are ``-1``."""

    kind: OpKind
    stage: int = -1
    sub: int = -1
    mb: int = -1
    peer: int = -1
    is_async: bool = False

    def __str__(self) -> str:
        k = self.kind
        name = _SHORT.get(k, k.name)
        if k == OpKind.VALIDATE:
            return name
        where = f"s{self.stage}" if self.sub < 0 else f"s{self.stage}.{self.sub}"
        parts = [name, where]
        if self.mb >= 0:
            parts.append(f"mb{self.mb}")
        if k in SENDS:
            parts.append(f"->r{self.peer}")
        elif k in RECVS or k == OpKind.WAIT_CKPT:
            parts.append(f"<-r{self.peer}")
        if self.is_async:
            parts.append("async")
        return " ".join(parts)

    @property
    def message(self) -> tuple[int, int, int, int]:
        """Identity of the message a send/recv/wait carries: (family, stage, sub, mb)."""
        fam = {OpKind.SEND_ACT: 0, OpKind.RECV_ACT: 0, OpKind.SEND_GRAD: 1, OpKind.RECV_GRAD: 1,
               OpKind.SEND_CKPT: 2, OpKind.RECV_CKPT: 2, OpKind.WAIT_CKPT: 2}[self.kind]
        return (fam, self.stage, self.sub, self.mb)


def F(stage: int, mb: int) -> Op:
    """``FORWARD stage mb``."""
    return Op(OpKind.FORWARD, stage, -1, mb)


def B(stage: int, sub: int, mb: int) -> Op:
    """``BACKWARD stage.sub mb``."""
    return Op(OpKind.BACKWARD, stage, sub, mb)


@dataclass(frozen=True)
class CkptRoute:
    """Where the checkpoint of ``(stage, sub)`` for micro-batch ``mb`` goes.

    ``mode``: ``"local"`` (producer and consumer share a rank: kept in GPU memory, no ops),
    ``"async"`` (isend/irecv posted at logical timestep ``step`` on both ranks, matched there;
    the receiver waits right before the backward) or ``"sync"`` (blocking send/recv at ``step``,
    right before the backward). ``src_index``/``dst_index``: positions of the SEND_CKPT and
    RECV_CKPT ops in the producer's and consumer's lists (``-1`` for local routes).
    """

    stage: int
    sub: int
    mb: int
    src: int
    dst: int
    mode: str
    step: float
    src_index: int = -1
    dst_index: int = -1


@dataclass(frozen=True)
class Schedule:
    """Per-rank op lists plus everything the runtime needs to execute them.

    ``ops[r]``: rank ``r``'s list. ``partition``: layer ranges of every stage / sub-stage.
    ``placement``: ranks of forward stages and backward sub-stages. ``ckpt_plan``: one route
    per ``(stage, sub, mb)`` checkpoint. ``options``: how it was built (schedule family, ablation
    config, optimizer and checkpoint modes, number of parameter buffers, ...).
    """

    name: str
    n_ranks: int
    n_micro: int
    partition: Partition
    placement: Placement
    ops: tuple[tuple[Op, ...], ...]
    ckpt_plan: tuple[CkptRoute, ...]
    options: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def n_stages(self) -> int:
        """Number of forward stages ``Nsf``."""
        return self.partition.n_stages

    @property
    def split(self) -> int:
        """Backward sub-stages per forward stage ``d``."""
        return self.partition.split

    def layers(self, op: Op) -> range:
        """Layers an op computes, loads, frees, offloads or steps."""
        return self.partition.layers(op.stage, op.sub)

    def format_ops(self, rank: int | None = None, width: int = 0) -> str:
        """Human-readable op lists (all ranks, or one)."""
        ranks = range(self.n_ranks) if rank is None else [rank]
        out = []
        for r in ranks:
            ops = self.ops[r]
            out.append(f"rank {r} ({len(ops)} ops):")
            for i, op in enumerate(ops):
                out.append(f"  {i:>{max(3, width)}}  {op}")
        return "\n".join(out)

    def with_ops(self, ops: Sequence[Sequence[Op]]) -> "Schedule":
        """A copy with other op lists; the checkpoint plan's op positions follow the new lists."""
        lists = tuple(tuple(x) for x in ops)
        where: dict[tuple[int, Op], int] = {}
        for r, lst in enumerate(lists):
            for i, op in enumerate(lst):
                if op.kind in (OpKind.SEND_CKPT, OpKind.RECV_CKPT):
                    where.setdefault((r, op), i)
        plan = []
        for rt in self.ckpt_plan:
            if rt.mode != "local":
                a = rt.mode == "async"
                si = where.get((rt.src, Op(OpKind.SEND_CKPT, rt.stage, rt.sub, rt.mb, rt.dst, a)), -1)
                di = where.get((rt.dst, Op(OpKind.RECV_CKPT, rt.stage, rt.sub, rt.mb, rt.src, a)), -1)
                rt = replace(rt, src_index=si, dst_index=di)
            plan.append(rt)
        return replace(self, ops=lists, ckpt_plan=tuple(plan))

    def count(self, kind: OpKind, rank: int | None = None) -> int:
        """How many ops of ``kind`` (on one rank or all)."""
        lists = self.ops if rank is None else [self.ops[rank]]
        return sum(1 for ops in lists for op in ops if op.kind == kind)
