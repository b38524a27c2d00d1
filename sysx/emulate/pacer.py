"""Pacing: how the runtime takes modelled time on an emulated device.

:class:`Pacer` is what a real device gets: its hooks return at once and change nothing.
:class:`EmulatedPacer` makes every op of the real runtime take the duration of the plan's
:class:`~sysx.schedule.costs.CostTable` (multiplied by the time scale), with the op semantics of
:mod:`sysx.schedule.simulate`, and keeps each step's largest lag and every op's ratio of real to
modelled time for :mod:`sysx.emulate.report`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from sysx import device as dev
from sysx.emulate.costs import UNDO_STEPS, EmulatedPlan
from sysx.emulate.report import StepStats
from sysx.emulate.streams import EmulatedEvent, EmulatedStream, sleep_until
from sysx.partition import unit_label
from sysx.schedule import Message, Op, OpKind, Schedule
from sysx.schedule.ops import COMMS, WAITS
from sysx.schedule.spread import spread_shares
from sysx.trace.recorder import RankPart

Handler = Callable[[Op], None]
_STAMP_TAG, _BACK_TAG = 7301, 7302  # gloo tags of the post times (apart from the payloads' tag 0)
P2P_NOISE_S = 1e-3  # a message left past its modelled end by less (wall) is host overhead, not counted


class Pacer:
    """No pacing (a real device): the runtime's own streams, its handlers unchanged, no time added."""

    active = False
    time_scale = 1.0

    def streams(self, device: torch.device) -> tuple[dev.Stream, dev.Stream, dev.Stream]:
        """``(compute, h2d, d2h)`` streams of a rank."""
        return dev.current_stream(device), dev.new_stream(device), dev.new_stream(device)

    def wrap(
        self, handlers: dict[OpKind, Handler], offload_event: Callable[[tuple[int, int]], dev.Event | None]
    ) -> dict[OpKind, Handler]:
        """The executor's handlers, paced (here: as they are)."""
        return handlers

    def begin_step(self, step: int, *, record: bool = True) -> None:
        """A step (or, ``record=False``, an evaluation) starts now."""
        return None

    def end_step(self, wall_s: float) -> float:
        """The step took ``wall_s`` on the wall clock; returns its reported duration."""
        return wall_s

    def optimizer_pace(self) -> Callable[[str, dev.Event | None], contextlib.AbstractContextManager[None]] | None:
        """What optimizer workers wrap a step in (None: nothing)."""
        return None

    def post(self, pending: Any, group: dist.ProcessGroup | None) -> None:
        """A message was posted (:class:`sysx.runtime.p2p.Pending`)."""
        return None

    def device_optimizer(self, name: str, seconds: tuple[float, float, float]) -> None:
        """A device-lane optimizer step of unit ``name`` was issued (``seconds``: its modelled copy
        in, step and copy out; :func:`sysx.optim.placement.device_seconds`). Here: nothing."""
        return None

    def device_optimizer_wait(self) -> None:
        """The host needs the device lane's results (its copies out are done). Here: nothing."""
        return None

    def settle(self, pending: Any, wait: Callable[[dist.Work], None]) -> None:
        """A posted message completed (``wait`` waits for one more of its works, bounded)."""
        return None

    def replica_reduce(self, name: str, ready: dev.Event | None) -> contextlib.AbstractContextManager[None]:
        """The cross-replica reduction of unit ``name``'s gradients runs inside (on the rank's
        reducer thread, units in backward order, after ``ready``: the unit's offload); the unit's
        optimizer job starts after it. Here: nothing added."""
        return contextlib.nullcontext()

    def unit_ready(self, name: str, t: float) -> None:
        """Unit ``name``'s gradients are ready for this rank's optimizer job from ``t`` (host clock: a
        spread step's hand-off, :mod:`sysx.runtime.spread_sync`). Here: nothing."""
        return None

    def replica_gather(self, nbytes: int) -> contextlib.AbstractContextManager[None]:
        """The exchange of updated 16-bit shards between nodes (``nbytes`` received by this rank)
        runs inside, after the step's validation. Here: nothing added."""
        return contextlib.nullcontext()

    def modelled(self, part: RankPart) -> RankPart:
        """A recorded timeline window (:mod:`sysx.trace`) in the device's seconds (here: as recorded)."""
        return part

    def disk_pace(self) -> Callable[[str, int], None] | None:
        """What the rank's NVMe tier (``optim.offload=nvme``) calls after each read and write
        (``"read"``/``"write"``, bytes). Here: None (the disk takes its own time)."""
        return None

    def calibrate_disk(self, real_bytes: int) -> None:
        """The tier holds ``real_bytes`` in one state file slot of each of the rank's stages (what
        one iteration reads). Here: nothing."""
        return None


class EmulatedPacer(Pacer):
    """Pacing of one rank of an emulated run (see docs/architecture.md)."""

    active = True

    def __init__(
        self,
        plan: EmulatedPlan,
        schedule: Schedule,
        rank: int,
        *,
        time_scale: float,
        group: dist.ProcessGroup | None = None,
        world: int = 1,
        rollback: str = "undo",
        stage_rank: int | None = None,
    ) -> None:
        self.plan, self.table, self.rank, self.time_scale = plan, plan.table, rank, float(time_scale)
        self.stage_rank = rank if stage_rank is None else stage_rank  # its pipeline rank (replicas: of the table)
        self.rollback = rollback  # what an undo costs (UNDO_STEPS)
        self._device_jobs: list[tuple[str, tuple[float, float, float]]] = []  # device-lane steps not yet charged
        self.group, self.world = group, world  # VALIDATE's modelled end is the latest rank's arrival
        self.split = schedule.partition.split
        self._head, self._head_igrad = schedule.partition.n_stages - 1, schedule.options.head_igrad
        self._parts = schedule.options.backward_parts  # a backward part, and its gradient, is 1/parts of the table's
        # the host issues the next compute op when the last one ends: the cursor is the stream's end
        self.compute = EmulatedStream("compute", issue=lambda: self.compute.free)
        self.h2d = EmulatedStream("h2d", issue=self.cursor)
        self.d2h = EmulatedStream("d2h", issue=self.cursor)
        self.asend_end = 0.0
        self.opt_end = 0.0  # the modelled end of the step's last optimizer job
        self.steps: list[StepStats] = []
        self._stats = StepStats(step=-1)
        self._lock = threading.Lock()
        self._worker = threading.local()
        d = self.split
        self._unit = {unit_label(s, k): s * d + k for s in range(len(self.table.fwd)) for k in range(d)}
        self._opt = {name: self.table.opt[g] for name, g in self._unit.items()}
        for unit, k in spread_shares(schedule).items():  # each sharer steps 1/k of the unit
            self._opt[unit_label(*unit)] /= k
        self.reduce_free = 0.0  # replicas: the modelled end of the reducer thread's last reduction
        self._reduced: dict[str, float] = {}  # this step's reduced units: their modelled ends
        # optim.offload=nvme: the rank's disk lane (sysx.schedule.disk), the ends of its latest reads
        self._disk_free, self._disk_scale = 0.0, 0.0  # nothing charged until calibrate_disk
        self._reads: deque[float] = deque(maxlen=64)
        self._owned = list(schedule.assignment.bwd_substages(self.stage_rank))
        self._running: dict[int, tuple[float, float, float]] = {}  # by worker thread: (t0, start, seconds)
        self._last_end = 0.0  # the modelled end of the last optimizer job that left
        self._disk_bandwidth = {"read": 1.0, "write": 1.0}

    # ---------------------------------------------------------------------------------- clock
    def cursor(self) -> float:
        """The rank's modelled time: the end of its compute stream's work."""
        return self.compute.free

    def streams(self, device: torch.device) -> tuple[dev.Stream, dev.Stream, dev.Stream]:
        """The emulated compute, H2D and D2H streams."""
        return self.compute, self.h2d, self.d2h

    def begin_step(self, step: int, *, record: bool = True) -> None:
        """Restart the cursor at the clock (the previous step ended with an all-reduce)."""
        self._stats = StepStats(step=step if record else -1)
        self.compute.free = time.monotonic()
        self.asend_end = 0.0
        self.opt_end = 0.0
        self.reduce_free = 0.0
        self._reduced = {}

    def end_step(self, wall_s: float) -> float:
        """Keep the step's figures; the reported duration is the modelled one (wall / time scale)."""
        self._stats.wall = wall_s
        # what the step did after its barrier (the loss all-reduce) has no modelled time: it is lag
        self._hold(min(self.compute.free, time.monotonic()), "end of step")
        if self._stats.step >= 0:
            self.steps.append(self._stats)
        return wall_s / self.time_scale

    def modelled(self, part: RankPart) -> RankPart:
        """The window in the emulated cluster's terms: wall-clock times divided by the time scale
        (modelled seconds, as the plan's) and the bytes of copies and messages those of the emulated
        model (the real tensors are the small model's)."""
        k = 1.0 / self.time_scale
        spans = [s._replace(start=s.start * k, end=s.end * k, nbytes=self._bytes(s.op, s.nbytes)) for s in part.spans]
        return dataclasses.replace(part, starts={step: t * k for step, t in part.starts.items()}, spans=spans)

    def _bytes(self, op: Op | None, real: int) -> int:
        """The emulated model's bytes moved by ``op`` (``real`` when it moves none)."""
        if op is None or not real:
            return real
        t, g = self.table, op.stage * self.split + op.sub
        if op.kind == OpKind.LOAD_PARAMS:
            return int(t.param_stage[op.stage] if op.sub < 0 else t.param_sub[g])
        if op.kind == OpKind.OFFLOAD_GRADS:
            return int(t.grad_mem[g])
        if op.kind in COMMS or op.kind in WAITS:
            family = op.message[0]
            if family == Message.GRAD:
                return int(self.plan.costs.act_bytes / self._parts)
            return int(t.ckpt_mem[g] if family == Message.CKPT else self.plan.costs.act_bytes)
        return real

    def _seconds(self, op: Op) -> float:
        """Wall seconds of ``op``'s modelled work."""
        t, g, k = self.table, op.stage * self.split + op.sub, op.kind
        # the Head's input gradient moved to its forward (schedule.head_input_grad), as the engine moves it
        whole = op.mb // self._parts if k == OpKind.BACKWARD else op.mb
        moved = t.head_igrad if op.stage == self._head and whole in self._head_igrad else 0.0
        if k == OpKind.FORWARD:
            x = t.fwd[op.stage] + moved
        elif k == OpKind.BACKWARD:
            x = (t.bwd[g] - moved) / self._parts
        elif k == OpKind.LOAD_PARAMS:
            x = t.load_stage[op.stage] if op.sub < 0 else t.load_sub[g]
        elif k == OpKind.OFFLOAD_GRADS:
            x = t.offload[g]
        else:
            x = t.opt[g]
        return x * self.time_scale

    def _label(self, what: object) -> str:
        return f"{what} (rank {self.rank}, step {self._stats.step})"

    def _ratio(self, kind: str, real: float, seconds: float, what: object) -> None:
        with self._lock:
            self._stats.ratios[kind].add(real / seconds if seconds > 0 else float(real > 0), self._label(what))

    def _hold(self, end: float, what: object) -> None:
        """The host waits until ``end``. A host already past it lags: the modelled times stay as they
        are (as a GPU's queue hides a slow host while it has work) and the largest lag is kept."""
        lag = time.monotonic() - end
        if lag <= 0:
            sleep_until(end)
            return
        with self._lock:
            if lag > self._stats.late:
                self._stats.late, self._stats.late_op = lag, self._label(what)

    # ------------------------------------------------------------------------------- handlers
    def wrap(
        self, handlers: dict[OpKind, Handler], offload_event: Callable[[tuple[int, int]], dev.Event | None]
    ) -> dict[OpKind, Handler]:
        """Paced FORWARD, BACKWARD, LOAD_PARAMS, OFFLOAD_GRADS, OPTIM_STEP and VALIDATE; messages are
        paced in :meth:`post` / :meth:`settle`."""
        paced = dict(handlers)
        paced[OpKind.FORWARD] = self._computing(handlers[OpKind.FORWARD])
        paced[OpKind.BACKWARD] = self._computing(handlers[OpKind.BACKWARD])
        paced[OpKind.LOAD_PARAMS] = self._copying(handlers[OpKind.LOAD_PARAMS], self.h2d, "h2d")
        paced[OpKind.OFFLOAD_GRADS] = self._copying(handlers[OpKind.OFFLOAD_GRADS], self.d2h, "d2h")
        paced[OpKind.OPTIM_STEP] = self._stepping(handlers[OpKind.OPTIM_STEP], offload_event)
        paced[OpKind.VALIDATE] = self._validating(handlers[OpKind.VALIDATE])
        if self.table.op_host > 0:
            paced = {kind: self._hosting(h) for kind, h in paced.items()}
        return paced

    def _hosting(self, handler: Handler) -> Handler:
        """Every instruction first takes the plan's host time on the cursor (the simulator charges
        it before the op): the real Python work of the op runs inside it, not as lag."""
        host = self.table.op_host * self.time_scale

        def paced(op: Op) -> None:
            self.compute.free += host
            handler(op)

        return paced

    def _computing(self, handler: Handler) -> Handler:
        def paced(op: Op) -> None:
            t0 = time.monotonic()
            handler(op)
            real = time.monotonic() - t0
            seconds = self._seconds(op)
            start, end = self.compute.charge(seconds)
            self._stats.busy += seconds
            self._stats.spans.append(("gpu", str(op), start, end))
            self._ratio("compute", real, seconds, op)
            self._hold(end, op)

        return paced

    def _copying(self, handler: Handler, stream: EmulatedStream, kind: str) -> Handler:
        def paced(op: Op) -> None:
            seconds = self._seconds(op)
            stream.charge_next(seconds)
            t0 = time.monotonic()
            handler(op)
            self._ratio(kind, time.monotonic() - t0, seconds, op)
            self._stats.spans.append((kind, str(op), stream.free - seconds, stream.free))

        return paced

    def _stepping(self, handler: Handler, offload_event: Callable[[tuple[int, int]], dev.Event | None]) -> Handler:
        def paced(op: Op) -> None:
            if op.is_async:  # a worker thread paces it (optimizer_pace)
                handler(op)
                return
            event = offload_event((op.stage, op.sub))
            if event is not None:
                event.wait(self.compute)  # the step starts when its gradients are on the host
            t0 = time.monotonic()
            handler(op)
            seconds = self._seconds(op)
            start, end = self.compute.charge(seconds)
            self._stats.spans.append(("cpu", str(op), start, end))
            self._ratio("optimizer", time.monotonic() - t0, seconds, op)
            self._hold(end, op)

        return paced

    def _validating(self, handler: Handler) -> Handler:
        def paced(op: Op) -> None:
            sleep_until(max(self.compute.free, self.d2h.free, self.asend_end))  # copies and sends done
            handler(op)  # waits for the optimizer workers, then the all-reduce: a real barrier
            done = time.monotonic()
            # the simulator's barrier ends when every rank's last copy, send and optimizer step has: real
            # work past that (a slow all-reduce, a worker descheduled by this machine) is lag like any other
            with self._lock:
                arrival = torch.tensor(
                    [max(self.compute.free, self.d2h.free, self.asend_end, self.opt_end, self.reduce_free)],
                    dtype=torch.float64,
                )
            if self.world > 1:  # ranks on one host share the monotonic clock (as the emulated device requires)
                dist.all_reduce(arrival, op=dist.ReduceOp.MAX, group=self.group)
            lag = done - float(arrival)
            if lag > 0:
                with self._lock:
                    if lag > self._stats.late:
                        self._stats.late, self._stats.late_op = lag, self._label(op)
            self.compute.free = max(self.compute.free, time.monotonic())

        return paced

    # ------------------------------------------------------------------------------ optimizer
    def optimizer_pace(self) -> Callable[[str, dev.Event | None], contextlib.AbstractContextManager[None]]:
        """The span a worker wraps a step of a stage in; made on the main thread at submission."""
        return self._optimizer_span

    def _optimizer_span(
        self, name: str, event: dev.Event | None, kind: str = "step"
    ) -> contextlib.AbstractContextManager[None]:
        """A ``kind`` job (step | undo | restep = undo + step) of stage ``name``; an undo takes
        :data:`~sysx.emulate.costs.UNDO_STEPS` steps' time for the run's ``optim.rollback``."""
        undo = UNDO_STEPS.get(self.rollback, 0.0)  # a mode not listed rolls back without arithmetic
        steps = {"step": 1.0, "undo": undo, "restep": undo + 1.0}[kind]
        return self._optimizer_job(name, self.compute.free, event, steps)

    @contextlib.contextmanager
    def _optimizer_job(
        self, name: str, submitted: float, event: dev.Event | None, steps: float = 1.0
    ) -> Iterator[None]:
        ready = event.timestamp() if isinstance(event, EmulatedEvent) and event.time is not None else 0.0
        t0 = time.monotonic()
        seconds = self._opt[name] * steps * self.time_scale
        me = threading.get_ident()
        with self._lock:
            self._running[me] = (t0, max(submitted, ready, getattr(self._worker, "free", 0.0)), seconds)
        try:
            yield
        finally:
            with self._lock:
                self._running.pop(me, None)
        now = time.monotonic()
        real = now - t0
        with self._lock:  # replicas: the job starts after the unit's reduction (known once the real one is)
            ready = max(ready, self._reduced.get(name, 0.0))
        start = max(submitted, ready, getattr(self._worker, "free", 0.0))
        data = self._data_ready(t0, now)  # NVMe tier: the job waited inside for its state's read
        if data > start:
            with self._lock:
                self._stats.spans.append(("disk", f"DISKWAIT {name}", start, data))
            start, real = data, now - data
        end = start + seconds
        self._ratio("optimizer", real, seconds, f"OPT {name}")
        with self._lock:
            self._stats.spans.append(("cpu", f"OPT {name}", start, end))
            self._last_end = end
        self._worker.free = end
        with self._lock:
            self.opt_end = max(self.opt_end, end)
        self._hold(end, f"OPT {name}")

    def device_optimizer(self, name: str, seconds: tuple[float, float, float]) -> None:
        """A device-lane step of unit ``name``: charged with the others at :meth:`device_optimizer_wait`."""
        self._device_jobs.append((name, seconds))

    def device_optimizer_wait(self) -> None:
        """Charge the device lane's units (issued now: the validation has just decided): every copy
        in on the H2D stream, each step on the compute stream after its copy in, each copy out on
        the D2H stream after its step, so the units flow through the three engines (both copy
        directions at full rate, as the placement model takes them); then the host waits for the
        last copy out (it needs the new states)."""
        jobs, self._device_jobs = self._device_jobs, []
        if not jobs:
            return
        self.h2d.after = max(self.h2d.after, time.monotonic())
        ins = [self.h2d.charge(s[0] * self.time_scale) for _, s in jobs]
        steps, outs = [], []
        for (_, s), (_, in_end) in zip(jobs, ins):
            # a step, then its copy out at once: the D2H stream issues at the compute cursor
            self.compute.after = max(self.compute.after, in_end)
            steps.append(self.compute.charge(s[1] * self.time_scale))
            self.d2h.after = max(self.d2h.after, steps[-1][1])
            outs.append(self.d2h.charge(s[2] * self.time_scale))
        with self._lock:
            for lane, spans in (("h2d", ins), ("gpu", steps), ("d2h", outs)):
                for (name, _), (begin, end) in zip(jobs, spans):
                    self._stats.spans.append((lane, f"OPT-dev {name}", begin, end))
        self._hold(self.d2h.free, "OPT-dev")

    # ------------------------------------------------------------------------------- NVMe tier
    def disk_pace(self) -> Callable[[str, int], None] | None:
        """The emulated disk lane of the rank (None when the plan has no NVMe tier): each read or
        write of the tier takes its bytes, scaled to the emulated sub-stages' state on disk
        (:meth:`calibrate_disk`), at the rank's share of the node's drives, in issue order
        (:mod:`sysx.schedule.disk`); the call returns at its modelled end."""
        return self._disk if self.plan.disk is not None else None

    def calibrate_disk(self, real_bytes: int) -> None:
        """The small real model's tier holds ``real_bytes`` per slot of the rank's stages: each of
        its transfers is charged as that share of the emulated ones."""
        disk = self.plan.disk
        if disk is None:
            return
        emulated = sum(disk.nbytes[s * self.split + k] for s, k in self._owned)
        self._disk_scale = emulated / real_bytes if real_bytes > 0 else 0.0
        self._disk_bandwidth = {"read": disk.read_bandwidth, "write": disk.write_bandwidth}

    def _disk(self, kind: str, nbytes: int) -> None:
        seconds = nbytes * self._disk_scale / self._disk_bandwidth[kind] * self.time_scale
        now = time.monotonic()
        if kind == "write":
            # a write-back leaves with its step's real (small) arithmetic: it is issued at the step's
            # modelled end, and reads issued before then go first (the lane serves in issue order)
            after = self._job_end(now)
            if after > now:
                sleep_until(after)
                now = time.monotonic()
        with self._lock:
            start = max(self._disk_free, now)
            end = self._disk_free = start + seconds
            self._stats.spans.append(("disk", kind.upper(), start, end))
            if kind == "read":
                self._reads.append(end)
        sleep_until(end)

    def _job_end(self, now: float) -> float:
        """The modelled end of the optimizer job running now (the earliest of several)."""
        with self._lock:
            running = list(self._running.values())
        ends = [max(start, self._data_ready(t0, now)) + seconds for t0, start, seconds in running]
        # none: the job whose write this is may have left already (its worker holds until its end)
        return min(ends, default=max(now, self._last_end))

    def _data_ready(self, t0: float, now: float) -> float:
        """The latest read that ended while an optimizer job ran from ``t0`` to ``now`` (0: none):
        the job waited for its state until then."""
        with self._lock:
            return max((e for e in self._reads if t0 < e <= now), default=0.0)

    def unit_ready(self, name: str, t: float) -> None:
        """A spread step's shard of ``name`` starts no earlier than the owner's offload (``t``)."""
        with self._lock:
            self._reduced[name] = max(self._reduced.get(name, 0.0), t)

    # ------------------------------------------------------------------------------- replicas
    @contextlib.contextmanager
    def replica_reduce(self, name: str, ready: dev.Event | None) -> Iterator[None]:
        """The reduction of unit ``name`` on the reducer thread: the table's ``reduce`` time from the
        later of its offload's end (``ready``) and the previous reduction's end; the unit's optimizer
        job starts at its end."""
        t0 = time.monotonic()
        yield
        real = time.monotonic() - t0
        # no offload event (nothing copied): the reduction could start when it was entered
        ready_at = ready.timestamp() if isinstance(ready, EmulatedEvent) and ready.time is not None else t0
        seconds = self.table.reduce[self._unit[name]] * self.time_scale if self.table.reduce else 0.0
        with self._lock:
            start = max(ready_at, self.reduce_free)
            end = self.reduce_free = start + seconds
            self._reduced[name] = end
            self._stats.spans.append(("reduce", f"RED {name}", start, end))
        self._ratio("reduce", real, seconds, f"RED {name}")
        self._hold(end, f"RED {name}")

    @contextlib.contextmanager
    def replica_gather(self, nbytes: int) -> Iterator[None]:
        """The exchange of this rank's updated shards after the step's validation (and any re-step):
        the table's ``gather`` time of the rank (the emulated model's bytes, not the ``nbytes`` of
        the small real one) from the end of its steps and copies; the next step starts after it."""
        t0 = time.monotonic()
        yield
        real = time.monotonic() - t0
        seconds = self.table.gather[self.stage_rank] * self.time_scale if self.table.gather else 0.0
        with self._lock:
            start = max(self.compute.free, self.d2h.free, self.opt_end)
            end = start + seconds
            self._stats.spans.append(("reduce", "GATHER", start, end))
        self.compute.free = end
        self._ratio("reduce", real, seconds, "GATHER")
        self._hold(end, "GATHER")

    # ------------------------------------------------------------------------------- messages
    def _xfer(self, spec: Any) -> float:
        """Wall seconds of the transfer of a :class:`sysx.runtime.p2p.TransferSpec`'s message."""
        t, g = self.table, spec.stage * self.split + spec.sub
        xfer = (
            t.act_xfer[spec.stage]
            if spec.family == Message.ACT
            else (t.grad_xfer[g] / self._parts if spec.family == Message.GRAD else t.ckpt_xfer[g])
        )
        return xfer * self.time_scale

    def post(self, pending: Any, group: dist.ProcessGroup | None) -> None:
        """Send this side's post time to the peer and receive the peer's (tags apart from payloads)."""
        mine = torch.tensor([self.cursor()], dtype=torch.float64)
        theirs = torch.empty(1, dtype=torch.float64)
        out_tag, in_tag = (_STAMP_TAG, _BACK_TAG) if pending.is_send else (_BACK_TAG, _STAMP_TAG)
        pending.extra = [
            dist.isend(mine, dst=pending.peer, group=group, tag=out_tag),
            dist.irecv(theirs, src=pending.peer, group=group, tag=in_tag),
        ]
        pending.stamps = (mine, theirs)
        if pending.is_send:  # VALIDATE waits for it: at least until its transfer could have ended
            self.asend_end = max(self.asend_end, self.cursor() + self._xfer(pending.spec))

    def settle(self, pending: Any, wait: Callable[[dist.Work], None]) -> None:
        """The transfer lasts the table's time from when both sides had posted (module doc)."""
        if not pending.extra:
            return
        for work in pending.extra:
            if not work.is_completed():
                wait(work)
        pending.extra = []
        spec = pending.spec
        seconds = self._xfer(spec)
        start = max(float(pending.stamps[0]), float(pending.stamps[1]))
        end = start + seconds
        if pending.is_send:
            with self._lock:
                self._stats.spans.append(("p2p", spec.label, start, end))
        if pending.is_send and not pending.sync:
            with self._lock:
                self.asend_end = max(self.asend_end, end)
            return
        self.compute.free = max(self.compute.free, end)
        past = time.monotonic() - self.compute.free  # > 0: the real delivery or the host was slower than the model
        with self._lock:
            self._stats.ratios["p2p"].add(max(past, 0.0), self._label(spec.label), over=P2P_NOISE_S)
        self._hold(self.compute.free, spec.label)
