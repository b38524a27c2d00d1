"""Probe (issue 27, twenty-third session), put on PYTHONPATH: with SYSX_SPANS=1 every rank records the wall-clock spans of
its step and of the step end (forward, backward, VALIDATE, the replicas reduction, the optimizer jobs, the collectives,
end_step) into /tmp/p23/spans-<RANK>.json at exit (``spans_report.py``, ``ab_chain.sh`` read them); with
SYSX_BLOCKWAIT=1 the collectives are waited for in ``Work.wait`` slices (``ab_wait.sh``: the probe of the change)."""

import atexit
import functools
import json
import os
import threading
import time

if os.environ.get("SYSX_SPANS") and "RANK" in os.environ:
    SPANS = []

    def _wrap(owner, name, label=None, arg=None):
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                extra = str(a[arg])[:60] if arg is not None and len(a) > arg else ""
                SPANS.append((label or name, threading.current_thread().name, t0, time.perf_counter(), extra))

        setattr(owner, name, inner)

    import sysx.dist as sd

    _wrap(sd, "_wait_collective" if hasattr(sd, "_wait_collective") else "_poll_collective", "collective", arg=3)
    import sysx.optim.threads as th

    _wrap(th, "_step_job", "opt_job")
    _wrap(th.OptimizerThreads, "wait", "threads.wait")
    _wrap(th.OptimizerThreads, "wait_stages", "wait_stages")
    import sysx.optim.step_protocol as sp

    _wrap(sp.StepProtocol, "decide", "decide")
    import sysx.runtime.replica_sync as rs

    _wrap(rs.GradReducer, "_reduce", "reduce")
    import sysx.runtime.executor as ex

    for n in ("_forward", "_backward", "_validate"):
        _wrap(ex.Executor, n, n)
    import sysx.runtime.rank as rk

    _wrap(rk.RankRuntime, "end_step", "end_step")
    import sysx.trainers.pipeline as tp

    _wrap(tp.PipelineTrainer, "train_step", "train_step")

    @atexit.register
    def _dump():
        with open(f"/tmp/p23/spans-{os.environ['RANK']}.json", "w") as f:
            json.dump(SPANS, f)


if os.environ.get("SYSX_BLOCKWAIT"):
    import datetime

    import sysx.dist as sd2
    from sysx import stopping

    def _blocking(work, timeout_s, watch, what):
        started = time.monotonic()
        job, deadline = sd2._Wait([work], timeout_s), started + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                job.completed = False
                return job
            try:
                job.completed = work.wait(datetime.timedelta(seconds=min(sd2.WAIT_SLICE_S, left)))
                return job
            except RuntimeError as err:
                if work.is_completed():
                    job.error = err
                    return job
            stopping.raise_if_requested()
            if watch is not None:
                watch.check(what)

    sd2._poll_collective = _blocking
