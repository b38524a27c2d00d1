"""Per-sub-stage CPU optimizer workers (paper §3.2 / §4 "CPU optimizer").

:class:`OptimizerThreads` steps each sub-stage on a worker as soon as its gradients are home
(:meth:`OptimizerThreads.submit_step`, with the event recorded after their device-to-host copy) and
returns a :class:`StageReport` per stage; rollbacks, re-steps, load-only jobs and the
``optim.rollback=exact`` spare refresh run on the same workers. :meth:`OptimizerThreads.close` (or
leaving the ``with`` block) cancels queued jobs and joins every thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from sysx.device import Event
from sysx.optim.stage import StageOptimizer, StageReport, now
from sysx.trace import Recorder, nvtx_range

log = logging.getLogger("sysx.optim")
T = TypeVar("T")
# (stage name, offload event[, job kind: step | undo | restep]) -> what a job runs in: the emulated
# device's modelled duration
Pace = Callable[..., contextlib.AbstractContextManager[None]]


def worker_device(device: torch.device | str | None) -> torch.device | None:
    """The GPU the workers must make current: ``device`` when it is a CUDA device; when None, the
    creating thread's current GPU if this process already uses CUDA; else None (CPU jobs never
    touch CUDA, so a GPU machine's CPU job creates no context)."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return None
        # "cuda" names no index: torch.cuda.set_device refuses it, so take the creating thread's
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


class OptimizerThreads:
    """A pool of optimizer worker threads for the sub-stages this rank owns."""

    def __init__(
        self,
        stages: Sequence[StageOptimizer],
        *,
        workers: int | None = None,
        threads_per_worker: int | None = None,
        name: str = "sysx-opt",
        device: torch.device | str | None = None,
        pace: Pace | None = None,
    ) -> None:
        if not stages:
            raise ValueError("OptimizerThreads: no stages given")
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"OptimizerThreads: stage names must be unique, got {names}")
        self.stages = {s.name: s for s in stages}
        self.workers = max(1, workers if workers is not None else len(stages))
        if threads_per_worker is not None and threads_per_worker < 1:
            raise ValueError(f"OptimizerThreads: threads_per_worker={threads_per_worker} must be >= 1")
        self.threads_per_worker = threads_per_worker
        # torch.set_num_threads also sets the count a thread takes at its first parallel op: fix
        # this thread's now, before a worker's (_init_worker) would become it
        torch.get_num_threads()
        self.device = worker_device(device)
        self.pace = pace  # steps (not checks, rollbacks or re-steps) take the emulated device's time
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=self.workers, thread_name_prefix=name, initializer=self._init_worker
        )
        self._pending: list[Future[StageReport]] = []
        self._last: dict[str, Future[Any]] = {}  # each stage's latest job
        self._lock = threading.Lock()
        self.recorder: Recorder | None = None  # set for a window of recorded steps (sysx.trace)
        log.info(
            "optimizer threads: %d worker(s) x %s intra-op thread(s) for %d stage(s): %s",
            self.workers,
            threads_per_worker if threads_per_worker is not None else torch.get_num_threads(),
            len(stages),
            ", ".join(names),
        )

    def _init_worker(self) -> None:
        if self.threads_per_worker is not None:
            # OpenMP's count for this thread; torch also keeps it as the default of threads that have
            # not computed yet (the creating thread fixed its own in __init__)
            torch.set_num_threads(self.threads_per_worker)
        if self.device is not None:
            # the current device is per thread: without this a worker's first CUDA call (an event
            # wait) would create a context on GPU 0
            torch.cuda.set_device(self.device)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            raise RuntimeError("OptimizerThreads: already closed")
        return self._pool

    def stage(self, name: str) -> StageOptimizer:
        """The stage called ``name``."""
        try:
            return self.stages[name]
        except KeyError:
            raise KeyError(f"OptimizerThreads: no stage {name!r}; stages: {list(self.stages)}") from None

    # ------------------------------------------------------------------------------ async steps
    def submit_step(
        self, name: str, grads: torch.Tensor, event: Event | None = None, *, scale: float = 1.0, lr: float
    ) -> Future[StageReport]:
        """Queue stage ``name``'s step: wait ``event``, load ``grads``, step if finite."""
        return self._submit_report(name, grads, event, scale, lr)

    def submit_load(
        self, name: str, grads: torch.Tensor, event: Event | None = None, *, scale: float = 1.0
    ) -> Future[StageReport]:
        """Queue stage ``name``'s check only: wait ``event``, load ``grads`` (no step)."""
        return self._submit_report(name, grads, event, scale, None)

    def _submit_report(
        self, name: str, grads: torch.Tensor, event: Event | None, scale: float, lr: float | None
    ) -> Future[StageReport]:
        pool = self._executor()  # "closed" before "no stage": close() lets go of the stages
        span = self.pace(name, event) if self.pace is not None and lr is not None else contextlib.nullcontext()
        future = pool.submit(_step_job, self.stage(name), grads, event, scale, lr, now(), span, self._recording())
        with self._lock:
            self._pending.append(future)
            self._last[name] = future
        return future

    def wait(self) -> list[StageReport]:
        """Wait for every submitted step; returns their reports in submission order.

        If a job raised, the others are still waited for, then the first error is raised.
        """
        with self._lock:
            pending, self._pending = self._pending, []
        return _results(pending)

    # ---------------------------------------------------------------------------- other jobs
    def run_all(
        self, fn: Callable[[StageOptimizer], T], names: Sequence[str], label: str, *, paced: str | None = None
    ) -> list[T]:
        """Run ``fn(stage)`` for each named stage on the workers; wait for all, return the results."""
        return _results([self.submit(fn, n, label, paced=paced) for n in names])

    def submit(
        self, fn: Callable[[StageOptimizer], T], name: str, label: str, *, paced: str | None = None
    ) -> Future[T]:
        """Queue ``fn(stage)`` for stage ``name``; :meth:`wait_stage` waits for it. ``paced``: what the
        job is on an emulated device's clock (``step``, ``undo``, ``restep``; None: no time)."""
        pool = self._executor()
        span = self.pace(name, None, paced) if self.pace is not None and paced else contextlib.nullcontext()
        future = pool.submit(_labelled_job, fn, self.stage(name), label, self._recording(), span)
        with self._lock:
            self._last[name] = future
        return future

    def refresh_spares(self, names: Sequence[str]) -> None:
        """Queue each named ``rollback=exact`` stage's spare refresh after its latest job, untracked:
        :meth:`wait_stage` (a block's load, the pipeline's end of step) does not wait for it; the
        stage's next step does (the state's lock). Call it once the validation has decided."""
        pool = self._executor()
        for name in names:
            stage = self.stage(name)
            if stage.optimizer.rollback != "exact":
                continue
            with self._lock:
                decided = self._last.get(name)
            # the stamp now (every speculative step of this iteration has reported): the step the
            # decision keeps; a later undoable step makes the refresh a no-op (see CpuAdam.refresh)
            pool.submit(_refresh_job, stage, decided, stage.optimizer.step_stamp, self._recording())

    def _recording(self) -> Recorder | None:
        """The recorder a job submitted now records into (None when off)."""
        rec = self.recorder
        return rec if rec is not None and rec.on else None

    def wait_stage(self, name: str) -> None:
        """Block until stage ``name``'s latest job is done (re-raises its error)."""
        with self._lock:
            future = self._last.get(name)
        if future is not None:
            future.result()

    def wait_stages(self) -> None:
        """Block until every stage's latest job is done (all are waited for, then the first error raised)."""
        with self._lock:
            futures = list(self._last.values())
        _results(futures)

    # ------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Cancel queued jobs, finish running ones, join all worker threads and let go of the
        stages, so their buffers can be freed (idempotent)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._pending.clear()
            self._last.clear()
        self.stages.clear()

    def __enter__(self) -> OptimizerThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _step_job(
    stage: StageOptimizer,
    grads: torch.Tensor,
    event: Event | None,
    scale: float,
    lr: float | None,
    t_submit: float,
    span: contextlib.AbstractContextManager[None],
    rec: Recorder | None = None,
) -> StageReport:
    """Wait for the copy, load and check; step too unless ``lr`` is None (a check only)."""
    with nvtx_range(f"OPT {stage.name}"):
        if event is not None:
            event.synchronize()
        t_ready = now()
        begin = rec.now() if rec is not None else 0.0  # the span starts once the gradients are home
        with span:
            stage.new_iteration()
            found_inf, sq = stage.load_grads(grads, scale=scale)
            stepped = lr is not None and not found_inf
            if lr is not None and stepped:
                stage.apply(lr)
            else:
                stage.drop_grads()
        if rec is not None:
            rec.add_job("" if lr is not None else "load", stage.name, begin, rec.now())  # "load": validate-first
        return StageReport(
            stage=stage.name,
            found_inf=found_inf,
            sq_norm=sq,
            pieces=stage.piece_squares,
            stepped=stepped,
            t_submit=t_submit,
            t_ready=t_ready,
            t_done=now(),
            thread=threading.current_thread().name,
        )


def _refresh_job(stage: StageOptimizer, decided: Future[object] | None, stamp: int, rec: Recorder | None) -> bool:
    """Refresh ``stage``'s spare once its decided job (undo, re-step, step) has run."""
    if decided is not None:
        try:
            decided.result()  # started before this job (FIFO): no deadlock on one worker
        except BaseException:
            return False
    with nvtx_range(f"OPT refresh {stage.name}"):
        begin = rec.now() if rec is not None else 0.0
        copied = stage.optimizer.refresh(stamp)
        if rec is not None and copied:
            rec.add_job("refresh", stage.name, begin, rec.now())
        return copied


def _labelled_job(
    fn: Callable[[StageOptimizer], T],
    stage: StageOptimizer,
    label: str,
    rec: Recorder | None = None,
    span: contextlib.AbstractContextManager[None] | None = None,
) -> T:
    with nvtx_range(f"OPT {label} {stage.name}"), span or contextlib.nullcontext():
        if rec is None:
            return fn(stage)
        begin = rec.now()
        result = fn(stage)
        rec.add_job(label, stage.name, begin, rec.now())
        return result


def _results(futures: Sequence[Future[T]]) -> list[T]:
    """The futures' results in order; if any raised, every one is still waited for, then the first
    error is raised (so no job is left running behind an exception)."""
    results: list[T] = []
    error: BaseException | None = None
    for future in futures:
        try:
            results.append(future.result())
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error
    return results
