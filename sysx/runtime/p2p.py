"""Point-to-point transfers between pipeline ranks: activations, input gradients, checkpoints.

Both ranks compute every transfer's :class:`TransferSpec` from the plan, and a disagreement is an
error (:class:`TransferMismatch`, optionally checked on the wire with ``verify``) rather than
garbage or a hang; a stuck or dead peer becomes a :class:`sysx.dist.PeerTimeout`. Asynchronous
operations return a :class:`Pending`, completed by :meth:`P2P.wait`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sysx.dist import posted, wait_for
from sysx.emulate.pacer import Pacer
from sysx.partition import unit_label
from sysx.schedule.ops import Message, Op
from sysx.trace.recorder import P2P as P2P_LANE
from sysx.trace.recorder import Mark, Recorder

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64, torch.int32)
_HEADER_LEN = 11
_MAGIC = 0x5359535850  # "SYSXP"
_MAX_DIMS = _HEADER_LEN - 7


class TransferMismatch(RuntimeError):
    """A tensor about to be sent, or a header received, does not match the planned transfer."""


@dataclass(frozen=True)
class TransferSpec:
    """The planned content of one message."""

    family: Message
    stage: int
    sub: int
    mb: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def label(self) -> str:
        """``ckpt s2.0 mb1``, ``act s3 mb0``, ``grad s5.1 mb2``."""
        return f"{self.family.label} {unit_label(self.stage, self.sub)} mb{self.mb}"

    def describe(self) -> str:
        """``ckpt s2.0 mb1 [2, 16, 128] torch.float32``."""
        return f"{self.label} {list(self.shape)} {self.dtype}"

    def check(self, tensor: torch.Tensor, *, rank: int, action: str) -> None:
        """Raise :class:`TransferMismatch` when ``tensor`` is not what the plan says."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise TransferMismatch(
                f"rank {rank}: {action} {self.label}: the tensor is {list(tensor.shape)} {tensor.dtype} but the plan says "
                f"{list(self.shape)} {self.dtype} (stage {self.stage}{'' if self.sub < 0 else f'.{self.sub}'}, "
                f"micro-batch {self.mb}, tensor {self.family.label}); every rank must run the same model, batch shape, "
                f"precision and schedule"
            )

    def header(self, device: torch.device) -> torch.Tensor:
        """The int64 header announcing this message."""
        if len(self.shape) > _MAX_DIMS:
            raise ValueError(f"{self.label}: {len(self.shape)} dimensions, the header holds {_MAX_DIMS}")
        values = [_MAGIC, int(self.family), self.stage, self.sub, self.mb, _DTYPES.index(self.dtype), len(self.shape)]
        values += list(self.shape) + [0] * (_MAX_DIMS - len(self.shape))
        return torch.tensor(values, dtype=torch.int64, device=device)

    @staticmethod
    def from_header(values: list[int]) -> TransferSpec | None:
        """Decode a header (None when it is not one)."""
        if len(values) != _HEADER_LEN or values[0] != _MAGIC or not 0 <= values[1] < len(Message):
            return None
        if not 0 <= values[5] < len(_DTYPES) or not 0 <= values[6] <= _MAX_DIMS:
            return None
        return TransferSpec(
            Message(values[1]), values[2], values[3], values[4], tuple(values[7 : 7 + values[6]]), _DTYPES[values[5]]
        )


@dataclass
class Pending:
    """An in-flight isend/irecv: its work handles and the buffers they use (kept alive here)."""

    spec: TransferSpec
    peer: int
    what: str
    works: list[dist.Work]
    buffer: torch.Tensor
    header: torch.Tensor | None = None
    is_send: bool = True
    done: bool = field(default=False)
    posted: tuple[Recorder, Op | None, Mark] | None = None  # recorded: the recorder, the posting op, its time
    sync: bool = False  # posted by a blocking send()/recv()
    extra: list[dist.Work] = field(default_factory=list)  # the emulated device's post times (sysx.emulate.pacer)
    stamps: tuple[Any, ...] = ()


class P2P:
    """Checked, time-bounded point-to-point messages of one rank (see docs/architecture.md)."""

    def __init__(
        self,
        rank: int,
        *,
        device: torch.device,
        timeout_s: float,
        verify: bool,
        group: dist.ProcessGroup | None = None,
        ckpt_group: dist.ProcessGroup | None = None,
        stream_ordered: bool | None = None,
        pacer: Pacer | None = None,
        peer_offset: int = 0,
    ) -> None:
        """``group``: activations and gradients (None: the default group); ``ckpt_group``:
        checkpoints (None: ``group``); ``stream_ordered``: synchronous transfers only order the
        compute stream (default: when the backend is NCCL); ``pacer``: the emulated device's;
        ``peer_offset``: added to the schedule's peers (pipeline ranks) to make global ranks (the
        first rank of this rank's replica, :mod:`sysx.replicas`). ``rank`` is the global rank."""
        self.rank = rank
        self.peer_offset = peer_offset
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.verify = bool(verify)
        self.group = group
        self.ckpt_group = ckpt_group if ckpt_group is not None else group
        if stream_ordered is None:
            stream_ordered = dist.is_initialized() and dist.get_backend(group) == "nccl"
        self.stream_ordered = bool(stream_ordered)
        self.pacer = pacer or Pacer()
        self.recorder: Recorder | None = None  # set for a window of recorded steps (sysx.trace)
        # with verify: the (peer, spec) pairs whose header went (or came) once. Both ranks compute
        # the same specs in the same order, and the plan repeats every step, so a disagreement
        # shows at its first message, which carries a header on both sides
        self._sent_headers: set[tuple[int, TransferSpec]] = set()
        self._received_headers: set[tuple[int, TransferSpec]] = set()

    def _first(self, seen: set[tuple[int, TransferSpec]], peer: int, spec: TransferSpec) -> bool:
        """True (and remembered) the first time ``spec`` travels to or from ``peer`` with verify on."""
        if not self.verify or (peer, spec) in seen:
            return False
        seen.add((peer, spec))
        return True

    # ------------------------------------------------------------------------------------ posting
    def isend(self, tensor: torch.Tensor, spec: TransferSpec, peer: int, what: str) -> Pending:
        """Post the send of ``tensor`` (checked against ``spec``) to pipeline rank ``peer``; returns the handle."""
        spec.check(tensor, rank=self.rank, action=f"{what}: sending")
        peer += self.peer_offset
        payload = tensor if tensor.is_contiguous() else tensor.contiguous()
        works: list[dist.Work] = []
        header, group = None, self._group(spec)
        if self._first(self._sent_headers, peer, spec):
            header = spec.header(payload.device)
            works.append(posted(dist.isend(header, dst=peer, group=group), what))
        works.append(posted(dist.isend(payload, dst=peer, group=group), what))
        pending = Pending(spec, peer, what, works, payload, header, is_send=True, posted=self._posted())
        self.pacer.post(pending, group)
        return pending

    def irecv(self, spec: TransferSpec, peer: int, what: str) -> Pending:
        """Post the receive of ``spec`` from pipeline rank ``peer`` into a fresh buffer; returns the handle."""
        buffer = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
        peer += self.peer_offset
        works: list[dist.Work] = []
        header, group = None, self._group(spec)
        if self._first(self._received_headers, peer, spec):
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            works.append(posted(dist.irecv(header, src=peer, group=group), what))
        works.append(posted(dist.irecv(buffer, src=peer, group=group), what))
        pending = Pending(spec, peer, what, works, buffer, header, is_send=False, posted=self._posted())
        self.pacer.post(pending, group)
        return pending

    def _posted(self) -> tuple[Recorder, Op | None, Mark] | None:
        rec = self.recorder
        if rec is None or not rec.on:
            return None
        # stream-ordered: the transfer runs after the compute issued so far, and the host is no clock of it
        return rec, rec.op, rec.mark() if self.stream_ordered else rec.now()

    def _record(self, pending: Pending) -> None:
        """A recorded message completed: its span, from the post to now (stream-ordered: to the point
        of the compute stream that waits for it), under the op that posted it."""
        if pending.posted is not None:
            rec, op, start = pending.posted
            end = rec.mark() if self.stream_ordered and not isinstance(start, float) else rec.now()
            rec.add(P2P_LANE, op, start, end, pending.buffer.numel() * pending.buffer.element_size())

    def _group(self, spec: TransferSpec) -> dist.ProcessGroup | None:
        return self.ckpt_group if spec.family == Message.CKPT else self.group

    # ----------------------------------------------------------------------------------- waiting
    def wait(self, pending: Pending, *, host: bool = True) -> torch.Tensor:
        """Wait for ``pending``; for a receive, check the header and return the received tensor.

        ``host=True``: the host waits (bounded by the timeout). ``host=False`` on a stream-ordered
        backend: the compute stream waits and the host goes on (a header to check still needs the host).
        """
        if pending.done:
            return pending.buffer
        if not host and self.stream_ordered and pending.header is None:
            for work in pending.works:
                work.wait()  # NCCL without a timeout: the current stream waits for the transfer, the host does not
            pending.done = True
            self._record(pending)
            return pending.buffer
        direction = "to" if pending.is_send else "from"
        what = f"{pending.what} ({'send' if pending.is_send else 'receive'} {pending.spec.label} {direction} rank {pending.peer})"
        works = pending.works
        if pending.header is not None and not pending.is_send:  # the header is checked before the payload lands
            wait_for(works[0], rank=self.rank, what=what, peer=pending.peer, timeout_s=self.timeout_s)
            self._check_header(pending)
            works = works[1:]
        wait_for(works, rank=self.rank, what=what, peer=pending.peer, timeout_s=self.timeout_s)
        self._settle(pending, what)
        pending.done = True
        self._record(pending)
        return pending.buffer

    def wait_sends(self, pendings: list[Pending], what: str) -> None:
        """Wait for posted sends all at once (one hand-over to the waiter thread, not one per send);
        ``what`` names the waiting op, the error names the sends and their peers."""
        left = [p for p in pendings if not p.done]
        if left:
            peers = sorted({p.peer for p in left})
            names = ", ".join(f"{p.spec.label} to rank {p.peer}" for p in left[:4])
            more = f" and {len(left) - 4} more" if len(left) > 4 else ""
            wait_for(
                [w for p in left for w in p.works],
                rank=self.rank,
                what=f"{what} (posted sends {names}{more})",
                peer=peers[0] if len(peers) == 1 else None,
                timeout_s=self.timeout_s,
            )
        for pending in pendings:
            if not pending.done:
                self._settle(pending, pending.what)
                pending.done = True
                self._record(pending)

    def _settle(self, pending: Pending, what: str) -> None:
        self.pacer.settle(
            pending, lambda work: wait_for(work, rank=self.rank, what=what, peer=pending.peer, timeout_s=self.timeout_s)
        )

    def _check_header(self, pending: Pending) -> None:
        got = TransferSpec.from_header([int(v) for v in pending.header.tolist()])  # type: ignore[union-attr]
        if got != pending.spec:
            sent = got.describe() if got is not None else f"not a sysx header {pending.header.tolist()}"  # type: ignore[union-attr]
            raise TransferMismatch(
                f"rank {self.rank}: {pending.what}: rank {pending.peer} sent {sent} but this rank expects "
                f"{pending.spec.describe()} (stage {pending.spec.stage}, micro-batch {pending.spec.mb}, tensor "
                f"{pending.spec.family.label}); the two ranks disagree about the plan: check that every rank runs the same "
                f"config and schedule"
            )

    def completed(self, pending: Pending) -> bool:
        """For a send: True once every work of ``pending`` has finished, so its buffer may go
        (never blocks). Receives are completed by :meth:`wait`, which checks the header."""
        if not pending.done and pending.is_send and all(w.is_completed() for w in [*pending.works, *pending.extra]):
            self._settle(pending, pending.what)
            pending.done = True
            self._record(pending)
        return pending.done

    def send(self, tensor: torch.Tensor, spec: TransferSpec, peer: int, what: str) -> None:
        """Synchronous send: later work is ordered after it (the host waits only off NCCL)."""
        pending = self.isend(tensor, spec, peer, what)
        pending.sync = True
        self.wait(pending, host=False)

    def recv(self, spec: TransferSpec, peer: int, what: str) -> torch.Tensor:
        """Synchronous receive: later work sees the data (the host waits only off NCCL)."""
        pending = self.irecv(spec, peer, what)
        pending.sync = True
        return self.wait(pending, host=False)
