"""Schedules as data: the :class:`Op` instruction, the checkpoint route and the :class:`Schedule`.

A schedule is, for every rank, an ordered list of ops; the runtime interprets each rank's list
unchanged, in order, and ``validate`` / ``simulate`` read the very same lists. Op kinds, in short:
LOAD_PARAMS / FREE (a unit's parameters into / out of a GPU buffer), FORWARD, BACKWARD (one
sub-stage, recomputed from its checkpoint), SEND/RECV of activations, gradients and checkpoints
(WAIT_ACT / WAIT_GRAD / WAIT_CKPT for a posted one), OFFLOAD_GRADS, OPTIM_STEP and VALIDATE (one all-reduce).
Ops are hashable frozen dataclasses whose ``str`` reads like ``F s3 mb2`` or ``B s5.1 mb0``.

With ``ScheduleOptions.backward_parts`` P > 1 a micro-batch's backward runs in P parts of its rows:
a BACKWARD's ``mb`` (and that of the GRAD messages between backwards) is then ``j * P + part`` for
forward micro-batch ``j``, while forwards, activations and checkpoints keep ``j``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from sysx.partition import Partition, RankAssignment, unit_label


class ScheduleError(ValueError):
    """A schedule that is impossible to build or that failed validation."""


class OpKind(enum.IntEnum):
    """What an op does (see docs/architecture.md)."""

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
    WAIT_ACT = 14
    WAIT_GRAD = 15


class Message(enum.IntEnum):
    """What a message between ranks carries; the value orders messages that are ready at once."""

    ACT = 0  # output of a forward stage
    GRAD = 1  # gradient w.r.t. the input of a backward sub-stage
    CKPT = 2  # checkpoint of a backward sub-stage

    @property
    def label(self) -> str:
        """``act``, ``grad`` or ``ckpt``."""
        return self.name.lower()

    @property
    def noun(self) -> str:
        """``activation``, ``gradient`` or ``checkpoint`` (for messages to people)."""
        return ("activation", "gradient", "checkpoint")[self.value]


SEND_OF = {Message.ACT: OpKind.SEND_ACT, Message.GRAD: OpKind.SEND_GRAD, Message.CKPT: OpKind.SEND_CKPT}
RECV_OF = {Message.ACT: OpKind.RECV_ACT, Message.GRAD: OpKind.RECV_GRAD, Message.CKPT: OpKind.RECV_CKPT}
WAIT_OF = {Message.ACT: OpKind.WAIT_ACT, Message.GRAD: OpKind.WAIT_GRAD, Message.CKPT: OpKind.WAIT_CKPT}
MESSAGE_OF = {
    **{k: m for m, k in SEND_OF.items()},
    **{k: m for m, k in RECV_OF.items()},
    **{k: m for m, k in WAIT_OF.items()},
}
SENDS = frozenset(SEND_OF.values())
RECVS = frozenset(RECV_OF.values())
WAITS = frozenset(WAIT_OF.values())  # the wait for a posted (async) receive, right before its reader
COMMS = SENDS | RECVS
PARTNER = {**{SEND_OF[m]: RECV_OF[m] for m in Message}, **{RECV_OF[m]: SEND_OF[m] for m in Message}}
_SHORT = {
    OpKind.FORWARD: "F",
    OpKind.BACKWARD: "B",
    OpKind.LOAD_PARAMS: "LOAD",
    OpKind.OFFLOAD_GRADS: "OFFLOAD",
    OpKind.OPTIM_STEP: "OPT",
}
# NVTX range names name the copy direction, not the op
_TRACE = {OpKind.LOAD_PARAMS: "H2D", OpKind.OFFLOAD_GRADS: "D2H", OpKind.FREE: "FREE"}


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
        parts = [name, unit_label(self.stage, self.sub)]
        if self.mb >= 0:
            parts.append(f"mb{self.mb}")
        if k in SENDS:
            parts.append(f"->r{self.peer}")
        elif k in RECVS or k in WAITS:
            parts.append(f"<-r{self.peer}")
        elif k == OpKind.OPTIM_STEP and self.peer >= 0:
            parts.append(f"shard of r{self.peer}")  # sysx.schedule.spread
        if self.is_async:
            parts.append("async")
        return " ".join(parts)

    @property
    def message(self) -> tuple[Message, int, int, int]:
        """Identity of the message a send/recv/wait carries: (kind, stage, sub, mb)."""
        return (MESSAGE_OF[self.kind], self.stage, self.sub, self.mb)

    def trace_name(self) -> str:
        """The NVTX range name: ``F s3 mb2``, ``B s5.1 mb0``, ``H2D s4``, ``D2H s5.1``, ``OPT s5.1``,
        ``OPT queue s5.1`` (async), ``SEND ckpt s2.0 mb1``, ``RECV act s3 mb0``, ``WAIT ckpt s2.0 mb1``."""
        k = self.kind
        where = unit_label(self.stage, self.sub)
        if k in (OpKind.FORWARD, OpKind.BACKWARD):
            return f"{_SHORT[k]} {where} mb{self.mb}"
        if k == OpKind.OPTIM_STEP:
            return f"OPT queue {where}" if self.is_async else f"OPT {where}"
        if k == OpKind.VALIDATE:
            return "VALIDATE"
        if k in _TRACE:
            return f"{_TRACE[k]} {where}"
        return f"{k.name.split('_')[0]} {MESSAGE_OF[k].label} {where} mb{self.mb}"


def F(stage: int, mb: int) -> Op:
    """``FORWARD stage mb``."""
    return Op(OpKind.FORWARD, stage, -1, mb)


def B(stage: int, sub: int, mb: int) -> Op:
    """``BACKWARD stage.sub mb``."""
    return Op(OpKind.BACKWARD, stage, sub, mb)


def grad_producer(op: Op, partition: Partition, head_igrad: frozenset[int] = frozenset(), parts: int = 1) -> Op | None:
    """The pass that computes backward ``op``'s output gradient: the next sub-stage's backward of
    the same part, or the Head's forward for a micro-batch in ``head_igrad`` (None for the last
    sub-stage). ``parts``: the schedule's ``backward_parts``."""
    nxt = partition.next_sub(op.stage, op.sub)
    if nxt is None:
        return None
    if op.mb // parts in head_igrad and partition.next_sub(*nxt) is None:
        return F(nxt[0], op.mb // parts)
    return B(nxt[0], nxt[1], op.mb)


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


CkptMode = Literal["local", "sync", "async"]
OptimizerMode = Literal["sync", "async"]
CKPT_MODES: tuple[CkptMode, ...] = ("local", "sync", "async")
OPTIMIZER_MODES: tuple[OptimizerMode, ...] = ("sync", "async")


@dataclass(frozen=True)
class ScheduleOptions:
    """How a schedule was built.

    ``ckpt``: ``"local"`` (coupled schedules: every checkpoint stays on its rank), ``"sync"``
    (blocking transfer right before the backward) or ``"async"`` (isend/irecv when produced).
    ``optimizer``: ``"sync"`` (step after VALIDATE) or ``"async"`` (step when offloaded, roll back
    at VALIDATE). ``param_buffers``: GPU stage buffers per rank. ``cfg``: the sysx ablation
    (paper Table 3), ``None`` for other schedules. ``training``: False for a forward-only
    evaluation program (no backward, no optimizer, no VALIDATE). ``keep_activations``: the forward
    keeps its autograd graph for the rank's own backward, which then backpropagates it instead of
    recomputing from the checkpoint (local checkpoints and whole-stage backwards only).
    ``head_igrad``: micro-batches whose Head input gradient its forward computes (the loss's
    gradient to the Head's input, right after the forward, on the forward's rank, sent from there
    to the sub-stage before the Head); the Head's backward sub-stage then recomputes and adds only
    its weight gradient for them. SysX with the Head a stage of its own only. ``backward_parts``:
    every micro-batch's backward runs in this many parts of its rows (module doc), each recomputed
    from its rows of the one checkpoint; the hop a micro-batch's backward takes from rank to rank
    shrinks to a part's.
    """

    ckpt: CkptMode
    optimizer: OptimizerMode
    param_buffers: int = 2
    cfg: int | None = None
    training: bool = True
    keep_activations: bool = False
    head_igrad: frozenset[int] = frozenset()
    backward_parts: int = 1

    def __post_init__(self) -> None:
        if self.ckpt not in CKPT_MODES:
            raise ScheduleError(f"ckpt mode {self.ckpt!r} must be 'local', 'sync' or 'async'")
        if self.optimizer not in OPTIMIZER_MODES:
            raise ScheduleError(f"optimizer mode {self.optimizer!r} must be 'sync' or 'async'")
        if not isinstance(self.param_buffers, int) or self.param_buffers < 1:
            raise ScheduleError(f"param_buffers={self.param_buffers!r} must be an int >= 1 (2 = current + prefetch)")
        if self.keep_activations and self.ckpt != "local":
            raise ScheduleError(
                f"keep_activations needs every backward on its forward's rank (local checkpoints), not ckpt={self.ckpt!r}"
            )
        if not isinstance(self.backward_parts, int) or self.backward_parts < 1:
            raise ScheduleError(f"backward_parts={self.backward_parts!r} must be an int >= 1 (1 = whole micro-batches)")
        if self.keep_activations and self.backward_parts > 1:
            raise ScheduleError("keep_activations backpropagates the forward's graph whole: backward_parts must be 1")

    def whole(self, mb: int) -> int:
        """The forward micro-batch of backward micro-batch index ``mb`` (``mb`` with one part)."""
        return mb // self.backward_parts

    @property
    def async_optimizer(self) -> bool:
        """True when sub-stages step as soon as their gradients are offloaded (validated afterwards)."""
        return self.optimizer == "async"


@dataclass(frozen=True)
class Schedule:
    """Per-rank op lists plus everything the runtime needs to execute them.

    ``ops[r]``: rank ``r``'s list. ``partition``: layer ranges of every stage / sub-stage.
    ``assignment``: ranks of forward stages and backward sub-stages. ``ckpt_plan``: one route
    per ``(stage, sub, mb)`` checkpoint. ``options``: how it was built (:class:`ScheduleOptions`).
    """

    name: str
    n_ranks: int
    n_micro: int
    partition: Partition
    assignment: RankAssignment
    ops: tuple[tuple[Op, ...], ...]
    ckpt_plan: tuple[CkptRoute, ...]
    options: ScheduleOptions

    @property
    def n_stages(self) -> int:
        """Number of forward stages ``Nsf``."""
        return self.partition.n_stages

    @property
    def split(self) -> int:
        """Backward sub-stages per forward stage ``d``."""
        return self.partition.split

    @property
    def n_backward(self) -> int:
        """Backward passes per sub-stage: ``n_micro`` times ``backward_parts``."""
        return self.n_micro * self.options.backward_parts

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
            out += [_op_row(i, op, width) for i, op in enumerate(ops)]
        return "\n".join(out)

    def with_ops(self, ops: Sequence[Sequence[Op]]) -> Schedule:
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


def _op_row(i: int, op: Op, width: int = 0) -> str:
    return f"  {i:>{max(3, width)}}  {op}"


def format_op_window(ops: Sequence[Op], index: int, around: int = 3) -> str:
    """The ops of one list around position ``index``, the op there marked ``<-- ERROR HERE``
    (the grid torch's pipelining schedules print when an action fails)."""
    lo, hi = max(0, index - around), min(len(ops), index + around + 1)
    rows = ["  ..."] if lo > 0 else []
    rows += [_op_row(i, ops[i]) + ("   <-- ERROR HERE" if i == index else "") for i in range(lo, hi)]
    if hi < len(ops):
        rows.append(f"  ... ({len(ops) - hi} more)")
    return "\n".join(rows)
