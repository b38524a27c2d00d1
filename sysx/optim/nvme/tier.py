"""``NvmeTier``: every stage's fp32 optimizer state in files, resident only while a job uses it.

Each stage (a pipeline backward sub-stage, a window group) keeps ``(p, m, v)`` in one state file
per *slot* (``p`` only when it is not the fp32 working copy in RAM). A job makes its stage
resident (:meth:`TieredState.resident`): the state is read into one of a few reused, page-aligned,
page-locked staging buffers, CpuAdam steps it there, and on release it is written back behind the
next jobs. Read-ahead fills the idle buffers with the stages least recently used, which in a
training loop (every stage stepped once per iteration, in the same order) are the next ones;
before the first step that is registration order. A buffer is reused only once its write is done,
and a buffer keeps its bytes after the write, so a stage used again soon (a rollback) reads none.

With two slots (``optim.rollback`` snapshot or exact) a step reads the current slot and its
result is written to the other one, which becomes current; a rollback makes the old slot current
again, bit for bit (:class:`TieredState` has the protocol of :class:`sysx.optim.exact.ExactState`,
so CpuAdam runs its exact rollback on it unchanged). See docs/architecture.md, "NVMe tier".
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from sysx.memory.pinned import PinnedStaging
from sysx.memory.views import LiveViewsError
from sysx.optim.nvme.io import IoEngine, aligned_nbytes
from sysx.optim.nvme.stream import StateStream

Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Pace = Callable[[str, int], None]  # ("read" | "write", bytes) after each transfer: the emulated disk's time
SLOTTED_ROLLBACKS = ("snapshot", "exact")  # rolled back by switching file slots


@dataclass(frozen=True)
class TierStage:
    """What one stage keeps on disk: ``numel`` fp32 parameters' ``m`` and ``v``, ``p`` too when
    ``with_param``, in ``slots`` files (2: ping-pong for a bit-exact rollback)."""

    name: str
    numel: int
    with_param: bool
    slots: int

    @classmethod
    def of(cls, name: str, numel: int, *, param_in_ram: bool, rollback: str) -> TierStage:
        """The stage for ``rollback`` (undo: one slot; snapshot, exact: two). ``param_in_ram``: the
        fp32 master is the working copy in RAM (fp32 runs); with two slots a copy of it is kept on
        disk all the same, so a rollback restores it from the old slot."""
        slots = 2 if rollback in SLOTTED_ROLLBACKS else 1
        return cls(name, numel, with_param=not param_in_ram or slots == 2, slots=slots)

    @property
    def region(self) -> int:
        """Bytes of one fp32 tensor in a file, rounded up to the I/O alignment."""
        return aligned_nbytes(4 * self.numel)

    @property
    def nbytes(self) -> int:
        """Bytes of one slot's file."""
        return (3 if self.with_param else 2) * self.region


@dataclass
class TierStats:
    """What the tier moved and how long jobs waited for it (seconds: ``time.perf_counter``)."""

    read_bytes: int = 0
    write_bytes: int = 0
    reads: int = 0
    writes: int = 0
    hits: int = 0  # residencies served by a buffer that already held the stage (no read)
    wait_s: float = 0.0  # jobs blocked on the tier: reads not done in time, buffers still writing
    read_s: float = 0.0  # the reads' time from issue to completion, summed (concurrent ones overlap)
    write_s: float = 0.0  # the writes' likewise
    per_stage_wait_s: dict[str, float] = field(default_factory=dict)


class _Buffer:
    """One staging buffer of the pool and the stage slot whose bytes it holds."""

    def __init__(self, staging: PinnedStaging) -> None:
        self.staging = staging
        self.key: tuple[str, int] | None = None  # (stage, slot) it holds or is reading; None: nothing
        self.io: Future[None] | None = None  # its last read or write
        self.user: str | None = None  # the stage resident in it

    def idle(self) -> bool:
        return self.user is None and (self.io is None or self.io.done())


class TieredState:
    """One stage's state in the tier: ``state`` is its resident ``(p, m, v)`` inside
    :meth:`resident`; the rest is the exact-rollback protocol CpuAdam drives."""

    def __init__(self, tier: NvmeTier, spec: TierStage) -> None:
        self.tier, self.spec = tier, spec
        self.current = 0  # the slot holding the state
        self.lock = threading.Lock()  # CpuAdam's step/refresh lock (rollback=exact's protocol)
        self.inline_copies = 0  # never: a step reads one slot and writes the other, no copy
        self._use = threading.RLock()  # one thread at a time makes the stage resident
        self._depth = 0
        self._buffer: _Buffer | None = None
        self._views: Triple | None = None
        self._param: torch.Tensor | None = None  # the RAM master when it is not on disk
        self._dirty = False

    @property
    def name(self) -> str:
        """The stage's name."""
        return self.spec.name

    @property
    def numel(self) -> int:
        """Parameters of the stage."""
        return self.spec.numel

    @property
    def slots(self) -> int:
        """State files of the stage (2: a step's result goes to the other slot)."""
        return self.spec.slots

    @property
    def spare_bytes(self) -> int:
        """Host bytes of the rollback's second set: none, it is the other slot on disk."""
        return 0

    @property
    def state(self) -> Triple:
        """The resident ``(p, m, v)`` of the current slot."""
        if self._views is None:
            raise RuntimeError(
                f"stage {self.name}: its optimizer state is on NVMe and not resident; use it inside "
                "StageOptimizer.resident()"
            )
        return self._views

    @contextlib.contextmanager
    def resident(self) -> Iterator[Triple]:
        """Hold the state in a staging buffer (reentrant); on leaving the outermost level a changed
        state is written back (to the current slot) behind the caller, an unchanged one kept cached.
        After an error inside, the buffer is dropped unwritten: the files keep the last good state."""
        with self._use:
            if self._depth == 0:
                self._bind(self.tier.acquire(self, read=True))
            self._depth += 1
            ok = False
            try:
                yield self.state
                ok = True
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._let_go(ok)

    def fill(self, master: torch.Tensor) -> None:
        """The initial state: ``p`` from ``master`` (fp32, flat; kept as the resident ``p`` when it
        stays in RAM), ``m = v = 0``, written to the current slot."""
        if master.numel() != self.numel or master.dtype != torch.float32:
            raise ValueError(f"stage {self.name}: the master must be {self.numel} fp32 elements, got {master.dtype}")
        if not self.spec.with_param:
            self._param = master.view(-1)
        with self._use:
            self._bind(self.tier.acquire(self, read=False))
            self._depth = 1
            try:
                p, m, v = self.state
                if self.spec.with_param:
                    p.copy_(master.view(-1))
                m.zero_()
                v.zero_()
                self._dirty = True
            finally:
                self._depth = 0
                self._let_go(True)

    def _bind(self, buf: _Buffer) -> None:
        self._buffer = buf
        n, region, staging = self.numel, self.spec.region, buf.staging
        views = [
            staging.view(torch.float32, n, byte_offset=i * region) for i in range(3 if self.spec.with_param else 2)
        ]
        if not self.spec.with_param:
            assert self._param is not None, f"stage {self.name}: fill() first"
            views.insert(0, self._param)
        self._views = (views[0], views[1], views[2])

    def _let_go(self, ok: bool) -> None:
        buf, dirty = self._buffer, self._dirty
        self._views = self._buffer = None
        self._dirty = False
        assert buf is not None
        self.tier.release(self, buf, write=ok and dirty, keep=ok)

    def locations(self) -> tuple[torch.Tensor | tuple[str, int], tuple[str, int], tuple[str, int]]:
        """Where the current slot's ``(p, m, v)`` lie: ``(path, byte offset)`` of each in the slot's
        file (``p``: the RAM master when it is not on disk). Current once :meth:`NvmeTier.flush`
        returns and while no job holds the stage (checkpoints read and write them there)."""
        path = self.tier._path(self.name, self.current)
        regions = [(path, i * self.spec.region) for i in range(3 if self.spec.with_param else 2)]
        if self.spec.with_param:
            return regions[0], regions[1], regions[2]
        assert self._param is not None, f"stage {self.name}: fill() first"
        return self._param, regions[0], regions[1]

    # ---------------------------------------------------------------- CpuAdam's state protocol
    def mark_stale(self) -> None:
        """The resident state was changed (a step in place, the device lane, a restore): it is
        written back when the stage is let go."""
        if self._views is None:
            raise RuntimeError(f"stage {self.name}: changed while not resident (use StageOptimizer.resident())")
        self._dirty = True

    def step_spare(self, step: Callable[[Triple], None]) -> None:
        """A step that may be rolled back: ``step`` the resident state, whose result belongs to the
        other slot (written there on release); the slot read stays on disk for :meth:`switch_back`."""
        step(self.state)
        self.current = 1 - self.current
        self._dirty = True

    def step_current(self, step: Callable[[Triple], None]) -> None:
        """A final step (never rolled back): written back to the current slot."""
        step(self.state)
        self._dirty = True

    def switch_back(self) -> None:
        """Roll the last step back: the slot it read is current again, read back into the buffer
        (its ``p`` rewrites the working copy)."""
        self.current = 1 - self.current
        if self._buffer is not None:
            self.tier.reload(self, self._buffer)
            self._dirty = False

    def refresh(self, allowed: Callable[[], bool]) -> bool:
        """Nothing to copy (the next step writes the other slot); ``allowed()`` is still asked, as
        it records that the decision kept the last step."""
        with self.lock:
            allowed()
        return False


class NvmeTier:
    """The state files of a set of stages and the staging buffers they are stepped in.

    ``engine`` moves whole files (:func:`sysx.optim.nvme.io.open_engine`); ``path(stage, slot)``
    names each stage slot's file (reserved beforehand, :class:`~sysx.optim.nvme.files.StateDir`);
    ``buffers`` staging buffers, each as large as the largest stage's file (one per optimizer
    worker plus read-ahead); ``pace(kind, nbytes)`` is called after each transfer (the emulated
    device charges its modelled disk time there); ``closers`` run at :meth:`close`."""

    def __init__(
        self,
        stages: Sequence[TierStage],
        engine: IoEngine,
        path: Callable[[str, int], str],
        *,
        buffers: int = 3,
        pace: Pace | None = None,
        pin: bool | None = None,
        closers: Sequence[Callable[[], None]] = (),
    ) -> None:
        names = [s.name for s in stages]
        if not stages or len(set(names)) != len(names):
            raise ValueError(f"NvmeTier: stage names must be given and unique, got {names}")
        if buffers < 1:
            raise ValueError(f"NvmeTier: buffers={buffers} must be >= 1")
        self.engine, self.pace, self._path = engine, pace, path
        self.stats = TierStats()
        self.stages = {s.name: TieredState(self, s) for s in stages}
        self.buffer_bytes = max(s.nbytes for s in stages)
        self._cond = threading.Condition()
        self._recent = list(names)  # least recently used first: the read-ahead order
        self._in_use: set[str] = set()
        self._unfilled = set(names)  # no read-ahead before every stage has its initial state on disk
        self._errors: dict[str, BaseException] = {}  # failed writes: the stage's files are stale
        self._closers = list(closers)
        self._stream: StateStream | None = None
        self._pin = pin
        self._closed = False
        self._waiting = 0  # jobs waiting for a free buffer (they come before the read-ahead)
        self._issuing = False  # a transfer's callback is run by the call that issues it (_transfer)
        self._pool: list[_Buffer] = []
        try:
            for i in range(buffers):
                staging = PinnedStaging(self.buffer_bytes, label=f"NVMe tier staging buffer {i}", pin=pin)
                self._pool.append(_Buffer(staging))
        except BaseException:
            self.close()
            raise
        self.depth = max(0, buffers - 1)  # stages read ahead; one buffer stays free for the unforeseen

    @property
    def host_bytes(self) -> int:
        """Host memory of the staging buffers."""
        return len(self._pool) * self.buffer_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of every state file."""
        return sum(s.spec.nbytes * s.spec.slots for s in self.stages.values())

    def state(self, name: str) -> TieredState:
        """The stage called ``name``."""
        try:
            return self.stages[name]
        except KeyError:
            raise KeyError(f"NvmeTier: no stage {name!r}; stages: {list(self.stages)}") from None

    def checkpoint_stream(self) -> StateStream:
        """The bounded stream checkpoints read and write the state files through (its two staging
        slots are made on first use and freed at :meth:`close`)."""
        with self._cond:
            self._check_open()
            if self._stream is None:
                self._stream = StateStream(self.engine, pin=self._pin)
                self._closers.insert(0, self._stream.close)
            return self._stream

    def forget(self, name: str) -> None:
        """Drop every cached copy of stage ``name`` (its files were rewritten behind the tier, by a
        checkpoint restore); waits for the transfers in flight first."""
        self.flush()
        with self._cond:
            if name in self._in_use:
                raise RuntimeError(f"NvmeTier: stage {name} is resident; its files cannot be replaced now")
            for buf in self._pool:
                if buf.key is not None and buf.key[0] == name:
                    buf.key = None

    # -------------------------------------------------------------------------- residency
    def acquire(self, st: TieredState, *, read: bool) -> _Buffer:
        """A buffer holding ``st``'s current slot (read, or found cached or read ahead); waits for
        its transfers and for every earlier one of the stage. ``read=False``: contents undefined."""
        name, key = st.name, (st.name, st.current)
        t0 = time.perf_counter()
        with self._cond:
            self._check_open()
            if name in self._errors:
                raise self._errors[name]
            waits = [b.io for b in self._pool if b.key is not None and b.key[0] == name and b.io is not None]
            # in use from now: while this waits for a buffer, the read-ahead must not read the stage too
            self._in_use.add(name)
            buf = self._holding(key) if read else None
            if buf is None:
                buf = self._take_idle()
                buf.key, buf.user = key, name
                buf.io = None
                if read:
                    self._transfer("read", buf, st.spec)
            else:
                self.stats.hits += 1
                buf.user = name
            if read:  # a use, not the initial fill: the read-ahead order follows the uses
                self._touch(name)
            io = buf.io
            self._read_ahead()
        try:
            for f in waits:  # the stage's earlier writes (any slot) land before it changes again
                with contextlib.suppress(BaseException):
                    f.result()
            if io is not None:
                io.result()
        except BaseException:
            self.release(st, buf, write=False, keep=False)
            raise
        finally:
            if read:  # a job's wait (the exposed I/O), not the initial fill's
                waited = time.perf_counter() - t0
                self.stats.wait_s += waited
                self.stats.per_stage_wait_s[name] = self.stats.per_stage_wait_s.get(name, 0.0) + waited
        return buf

    def release(self, st: TieredState, buf: _Buffer, *, write: bool, keep: bool) -> None:
        """``st`` lets go of ``buf``: written back to its current slot when ``write``, kept as a
        cache of it when ``keep``, else forgotten."""
        with self._cond:
            self._in_use.discard(st.name)
            buf.user = None
            key = (st.name, st.current)
            if write:
                self._unfilled.discard(st.name)
            if write:
                for other in self._pool:
                    if other is not buf and other.key == key:
                        other.key = None  # an older copy of the slot
                buf.key = key
                self._transfer("write", buf, st.spec)
            elif not keep:
                buf.key = None
            self._cond.notify_all()
            self._read_ahead()

    def reload(self, st: TieredState, buf: _Buffer) -> None:
        """Read ``st``'s current slot into its resident ``buf`` again (a rollback)."""
        with self._cond:
            for other in self._pool:
                if other is not buf and other.key == (st.name, st.current):
                    other.key = None  # read into the resident buffer instead
            buf.key = (st.name, st.current)
            io = self._transfer("read", buf, st.spec)
        io.result()

    def _holding(self, key: tuple[str, int]) -> _Buffer | None:
        return next((b for b in self._pool if b.key == key), None)

    def _take_idle(self) -> _Buffer:
        """An idle buffer (an empty one first, else the one holding the most recently used stage,
        needed last); waits while every buffer is in use or writing. Holds the lock."""
        while True:
            self._check_open()
            idle = [b for b in self._pool if b.idle()]
            if idle:
                return max(idle, key=self._reuse_rank)
            self._waiting += 1  # the read-ahead leaves the next free buffer to this job
            try:
                self._cond.wait()
            finally:
                self._waiting -= 1

    def _reuse_rank(self, buf: _Buffer) -> int:
        if buf.key is None:
            return len(self._recent)
        return self._recent.index(buf.key[0])

    def _touch(self, name: str) -> None:
        self._recent.remove(name)
        self._recent.append(name)

    def _read_ahead(self) -> None:
        """Start reading the next stages (least recently used first, up to :attr:`depth`) into idle
        buffers that hold none of them. Holds the lock."""
        if self._closed or self._unfilled or self._waiting:
            return
        targets = [n for n in self._recent if n not in self._in_use][: self.depth]
        for name in targets:
            st = self.stages[name]
            if self._holding((name, st.current)) is not None:
                continue
            free = [b for b in self._pool if b.idle() and (b.key is None or b.key[0] not in targets)]
            if not free:
                return
            buf = max(free, key=self._reuse_rank)
            buf.key = (name, st.current)
            self._transfer("read", buf, st.spec)

    def _transfer(self, kind: str, buf: _Buffer, spec: TierStage) -> Future[None]:
        """Start reading or writing ``buf``'s slot file and make it ``buf.io``; that future
        completes after the ``pace`` hook. Holds the lock.

        An engine's op may be done before its callback is added (a fast read), and the callback
        then runs here, inside the caller, before the caller has finished with the pool: so it
        starts no read-ahead (``_issuing``; the callers do that once the pool is consistent), or a
        read-ahead could take the very buffer a job was just given."""
        assert buf.key is not None
        path = self._path(*buf.key)
        view = buf.staging.view(torch.uint8, spec.nbytes)
        done: Future[None] = Future()
        buf.io = done
        stage = buf.key[0]
        issued = time.perf_counter()
        io = self.engine.read(path, view) if kind == "read" else self.engine.write(path, view)

        def finished(f: Future[None]) -> None:
            took = time.perf_counter() - issued  # the disk's own time (before an emulated pace)
            error = f.exception()
            if error is None and self.pace is not None:
                try:
                    self.pace(kind, spec.nbytes)
                except BaseException as exc:
                    error = exc
            with self._cond:
                if kind == "read":
                    self.stats.reads += 1
                    self.stats.read_bytes += spec.nbytes
                    self.stats.read_s += took
                else:
                    self.stats.writes += 1
                    self.stats.write_bytes += spec.nbytes
                    self.stats.write_s += took
                    if error is not None:
                        self._errors[stage] = error
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)
            with self._cond:
                self._cond.notify_all()
                if not self._issuing:
                    self._read_ahead()

        self._issuing = True  # read under the lock, so only a callback run by this very call sees it
        try:
            io.add_done_callback(finished)
        finally:
            self._issuing = False
        return done

    # --------------------------------------------------------------------------- lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("NvmeTier: already closed")

    def flush(self) -> None:
        """Wait for every transfer in flight; raise the first failed write."""
        with self._cond:
            pending = [b.io for b in self._pool if b.io is not None]
        for f in pending:
            with contextlib.suppress(BaseException):
                f.result()
        with self._cond:
            if self._errors:
                raise next(iter(self._errors.values()))

    def close(self) -> None:
        """Wait for the transfers, free the buffers and run the closers (removing the files);
        idempotent. A failed write is raised after everything is released."""
        error: BaseException | None = None
        with self._cond:  # first: a transfer finishing during the flush starts no read-ahead into a buffer
            self._closed = True
            self._cond.notify_all()
        try:
            self.flush()
        except BaseException as exc:
            error = exc
        for st in self.stages.values():
            st._views = st._buffer = st._param = None
        pool, self._pool = self._pool, []
        for buf in pool:
            buf.io = None
            try:
                _close_staging(buf.staging)
            except LiveViewsError as exc:
                error = error or exc
        closers, self._closers = self._closers, []
        for close in closers:
            try:
                close()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error


def _close_staging(staging: PinnedStaging, *, tries: int = 100) -> None:
    """Free a staging buffer once the views of finished transfers are gone: an engine's worker may
    still hold its request's view for a moment after the transfer's future completed, and an
    exception's traceback may hold one in a reference cycle."""
    for _ in range(tries - 1):
        try:
            staging.close()
            return
        except LiveViewsError:
            gc.collect()
            time.sleep(0.01)
    staging.close()
