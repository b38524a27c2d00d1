"""The NVMe tier's reads and writes (``optim.offload=nvme``) beside a simulated iteration.

Each owner of a backward sub-stage keeps the sub-stage's fp32 optimizer state on the node's NVMe
drives (:mod:`sysx.optim.nvme`). Its model, which the emulated device's pacer charges alike
(:meth:`sysx.emulate.pacer.EmulatedPacer.disk_pace`):

* a rank's I/O runs in issue order on one disk lane at its share of the node's drives (the
  node's read or write bandwidth / its ranks: SysX's ranks step their sub-stages side by side all
  through the backward, so each is served about that share while the disk is the bottleneck);
* the sub-stages are stepped in the order of the rank's OPTIM_STEP ops, and their reads run ahead
  in that order, round the iteration's end into the next, into ``slots`` reused staging buffers
  (:class:`sysx.optim.nvme.tier.NvmeTier`: one per optimizer worker and two more): a job takes a
  buffer once its gradients are home and a worker is free, the next ``slots - 1`` sub-stages are
  read ahead, and a buffer is free again once its sub-stage's write-back ended; so sub-stage
  ``n``'s read is issued at ``max(job n - (slots - 1) took its buffer, write-back n - slots ended)``;
* a step starts at ``max(gradients ready, a worker free, its state read)``; its write-back is
  issued when it ends and runs behind the next steps.

:func:`with_disk` replays the optimizer jobs of a simulated :class:`~sysx.schedule.simulate.Timeline`
(its events) with that lane for a few iterations and returns the steady state. For an
asynchronous optimizer the replay is exact: the jobs feed nothing but the step's closing barrier
(VALIDATE), so the iteration is the barrier's latest arrival. A synchronous step holds its rank's
cursor: its wait is added to the rank's end, an upper bound.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from sysx.schedule.costs import CostTable
from sysx.schedule.ops import OpKind, Schedule
from sysx.schedule.simulate import Timeline

STEADY_ITERATIONS = 4  # replayed iterations; the first is cold (every read issued at its start)


@dataclass(frozen=True)
class DiskCosts:
    """Each sub-stage's (``s * split + k``) state bytes on disk (its rank's part: 1/R with
    replicas), the bandwidths of a rank's share of the node's drives (bytes/s), and the staging
    buffers of a rank."""

    nbytes: list[float]
    read_bandwidth: float
    write_bandwidth: float
    slots: int = 2

    @property
    def read(self) -> list[float]:
        """Seconds of each sub-stage's read."""
        return [b / self.read_bandwidth for b in self.nbytes]

    @property
    def write(self) -> list[float]:
        """Seconds of each sub-stage's write-back."""
        return [b / self.write_bandwidth for b in self.nbytes]


def disk_costs(
    table: CostTable,
    *,
    state_bytes_per_param: float,
    read_bandwidth: float,
    write_bandwidth: float,
    ranks_per_node: int,
    slots: int = 2,
) -> DiskCosts:
    """:class:`DiskCosts` of ``table``'s sub-stages: each reads and writes ``state_bytes_per_param``
    x its parameters (its 1/R shard with replicas) at ``1/ranks_per_node`` of the node's
    ``read_bandwidth`` / ``write_bandwidth`` (bytes/s)."""
    if not (read_bandwidth > 0 and write_bandwidth > 0):
        raise ValueError(f"disk bandwidths {read_bandwidth!r}/{write_bandwidth!r} must be > 0 bytes/s")
    if slots < 1:
        raise ValueError(f"slots={slots!r} must be >= 1 staging buffer")
    share = max(1, ranks_per_node)
    nbytes = [n * state_bytes_per_param / table.replicas for n in table.params_sub]
    return DiskCosts(nbytes, read_bandwidth / share, write_bandwidth / share, slots)


@dataclass
class DiskTimeline:
    """The steady-state iteration with the tier beside the timeline's own (seconds)."""

    iteration: float  # with the tier
    base: float  # without it (the timeline's)
    wait: list[float]  # per rank: seconds its steps waited for their state to be read
    read: list[float]  # per rank: seconds of reads per iteration
    write: list[float]  # per rank: seconds of write-backs per iteration
    iterations: list[float] = field(default_factory=list)  # every replayed iteration, the cold first one too

    @property
    def exposed(self) -> float:
        """Seconds the disk adds to an iteration."""
        return max(0.0, self.iteration - self.base)

    @property
    def busy(self) -> float:
        """The busiest rank's disk-lane seconds per iteration (its reads and writes)."""
        return max((r + w for r, w in zip(self.read, self.write)), default=0.0)


@dataclass
class _Job:
    unit: int
    ready: float  # gradients on the host, from the iteration's start
    opt: float  # the step's seconds
    sync: bool


class _Lane:
    """One rank's disk lane, its staging buffers and its workers, across iterations (reads,
    acquisitions and write-backs numbered over all iterations: job ``n`` is ``jobs[n % len]``)."""

    def __init__(self, jobs: list[_Job], disk: DiskCosts, workers: int | None) -> None:
        self.jobs, self.workers, self.slots = jobs, workers, disk.slots
        self.depth = max(1, disk.slots - 1)  # stages read ahead of the one in use
        self.seconds = {"r": disk.read, "w": disk.write}
        self.free = 0.0  # the lane's end so far
        self.queue: list[tuple[float, int, str, int]] = []  # (issue time, seq, "r"|"w", job number)
        self.seq = 0
        self.next_read = 0  # reads issued so far
        self.acquired: dict[int, float] = {}  # by job number: when its job took its buffer
        self.written: dict[int, float] = {}  # by job number: its write-back's end
        self.read_end: dict[int, float] = {}  # by job number
        self.heap: list[float] = []  # workers' ends
        self._issue_reads()

    def _issue_reads(self) -> None:
        """Issue every read now allowed: read ``n`` once job ``n - depth`` took its buffer (it is
        among the next ``depth`` stages) and job ``n - slots``'s write-back freed a buffer. (The
        tier serves a stage still cached in a buffer without reading; with more sub-stages than
        buffers, as a rank has, none is.)"""
        while True:
            n = self.next_read
            # the same sub-stage's previous write-back too (a rank of fewer sub-stages than buffers)
            a, w, same = n - self.depth, n - self.slots, n - len(self.jobs)
            if (a >= 0 and a not in self.acquired) or any(x >= 0 and x not in self.written for x in (w, same)):
                return
            issue = max(self.acquired.get(a, 0.0), self.written.get(w, 0.0), self.written.get(same, 0.0))
            self._push(issue, "r", n)
            self.next_read += 1

    def _push(self, t: float, kind: str, n: int) -> None:
        heapq.heappush(self.queue, (t, self.seq, kind, n))
        self.seq += 1

    def _serve(self) -> None:
        """Serve the earliest-issued request."""
        t, _, kind, n = heapq.heappop(self.queue)
        unit = self.jobs[n % len(self.jobs)].unit
        start = max(t, self.free)
        self.free = start + self.seconds[kind][unit]
        if kind == "r":
            self.read_end[n] = self.free
        else:
            self.written[n] = self.free
            self._issue_reads()

    def iterate(self, it: int, start: float) -> tuple[float, float, float]:
        """Step iteration ``it`` (begun at ``start``): (the end of its last step, its steps' wait
        for reads, the synchronous steps' wait)."""
        end, wait, sync_wait = start, 0.0, 0.0
        n0 = it * len(self.jobs)
        for i, job in enumerate(self.jobs):
            n = n0 + i
            # the job takes its buffer once its gradients are home and a worker is free
            ready = start + job.ready
            if self.workers is not None and not job.sync and len(self.heap) >= self.workers:
                ready = max(ready, heapq.heappop(self.heap))
            self.acquired[n] = ready
            self._issue_reads()
            while n not in self.read_end:
                self._serve()
            st = max(ready, self.read_end.pop(n))
            if job.sync:
                sync_wait += st - ready
            else:
                wait += st - ready
            en = st + job.opt
            if self.workers is not None and not job.sync:
                heapq.heappush(self.heap, en)
            self._push(en, "w", n)
            end = max(end, en)
        return end, wait, sync_wait


def _jobs(schedule: Schedule, timeline: Timeline, table: CostTable) -> list[list[_Job]]:
    """Every rank's optimizer jobs in list order, with their gradients' ready times."""
    d = table.split
    ready: dict[tuple[int, int], float] = {}
    for e in timeline.events:
        if e.lane in ("d2h", "reduce") and e.op.kind == OpKind.OFFLOAD_GRADS:
            key = (e.rank, e.op.stage * d + e.op.sub)
            ready[key] = max(ready.get(key, 0.0), e.end)
    starts = {(e.rank, e.op.stage * d + e.op.sub): e.start for e in timeline.events if e.lane == "cpu"}
    out = []
    for r, ops in enumerate(schedule.ops):
        jobs = []
        for op in ops:
            if op.kind != OpKind.OPTIM_STEP:
                continue
            g = op.stage * d + op.sub
            # a synchronous step is ready when the cursor reached it (and its gradients were offloaded)
            at = ready.get((r, g), 0.0) if op.is_async else starts.get((r, g), 0.0)
            jobs.append(_Job(g, at, table.opt[g], not op.is_async))
        out.append(jobs)
    return out


def with_disk(
    schedule: Schedule, timeline: Timeline, table: CostTable, disk: DiskCosts, *, iterations: int = STEADY_ITERATIONS
) -> DiskTimeline:
    """The steady state of ``timeline`` (recorded: its events) with ``disk``'s tier (module doc)."""
    if not timeline.events and any(schedule.ops):
        raise ValueError("with_disk needs a recorded timeline: simulate(..., record=True)")
    jobs = _jobs(schedule, timeline, table)
    lanes = [_Lane(j, disk, table.optim_workers) for j in jobs]
    base = timeline.iteration
    gather = max(table.gather, default=0.0)
    start, its, waits = 0.0, [], [0.0] * len(jobs)
    for it in range(iterations):
        length = base
        for r, lane in enumerate(lanes):
            if not lane.jobs:
                continue
            end, wait, sync_wait = lane.iterate(it, start)
            waits[r] = wait + sync_wait
            # the barrier waits for every rank's steps, the all-reduce follows (replicas: then the shard exchange)
            length = max(length, base + sync_wait, end - start + table.allreduce + gather)
        its.append(length)
        start += length
    read, write = disk.read, disk.write
    reads = [sum(read[j.unit] for j in js) for js in jobs]
    writes = [sum(write[j.unit] for j in js) for js in jobs]
    return DiskTimeline(its[-1] if its else base, base, waits, reads, writes, its)


def hiding_point(hidden_at: Callable[[int], bool], *, start: int = 1, limit: int = 4096) -> int | None:
    """The fewest micro-batches ``m >= start`` at which ``hidden_at(m)`` (the disk hides behind the
    step: exposed I/O within tolerance) holds, doubling then bisecting (the step grows with ``m``,
    the I/O does not); None when it does not by ``limit``."""
    lo, hi = start, start
    while not hidden_at(hi):
        if hi >= limit:
            return None
        lo, hi = hi + 1, min(2 * hi, limit)
    while lo < hi:
        mid = (lo + hi) // 2
        if hidden_at(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi
