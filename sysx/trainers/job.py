"""The body of every ``sysx-train`` job: resume, describe the run, train with logging and
checkpoints, save at the end, close. The trainers' ``train(cfg, info)`` functions call
:func:`run_job` once their trainer is built.

A stop (SIGINT/SIGTERM here or on another rank, :mod:`sysx.stopping`) ends the job through the
same close path: the other ranks are told through the store first, rank 0 writes
``summary.json`` with ``"stopped"``, and :class:`~sysx.stopping.JobStopped` goes up to
``sysx-train``, which exits with 130 or 143. With ``checkpoint.on_signal=true`` the step in
progress finishes and every rank saves before stopping. A failure is published to the other
ranks before this rank starts closing, so they stop at once instead of after ``schedule.timeout_s``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator
from pathlib import Path

from sysx import peers, stopping
from sysx.config import SysxConfig
from sysx.config.choices import EMULATED_DEVICE
from sysx.memory.views import drop_failure_views
from sysx.metrics import SUMMARY_FILE, RunLogger
from sysx.run_dir import describe_run, prepare_run_dir
from sysx.stopping import JobStopped
from sysx.tracking import open_backends
from sysx.trainers.base import Trainer
from sysx.trainers.checkpointing import JobCheckpoints
from sysx.trainers.throughput import compute_rate


@contextlib.contextmanager
def long_lived_heap() -> Iterator[None]:
    """Collect once, then keep every object that exists now out of the garbage collector until the
    block ends (:func:`gc.freeze`; :func:`gc.unfreeze` after, so a process running several jobs, a
    test session, collects them again).

    What exists when training starts lives as long as the job: torch, the model's modules, the
    config, the tuner's results, some 235,000 objects in a tiny job. Each full collection walked
    them all: 104-245 ms on the 2-core VM, once or twice in a 20-step tiny job whose steps take
    0.13 s (a pause every rank of a pipeline waits for). Frozen, a full collection took 14 ms.
    Objects of the frozen heap are still freed when their last reference goes; only reference
    cycles among them wait for the unfreeze."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_job(trainer: Trainer, *, is_main: bool = True, extra: str = "") -> int:
    """Train ``trainer`` to ``train.steps`` (from the checkpoint ``train.resume`` finds, if any). Returns 0."""
    cfg = trainer.cfg
    checkpoints: JobCheckpoints | None = None
    logger: RunLogger | None = None
    finished = False
    try:
        checkpoints = JobCheckpoints(trainer)
        resumed = checkpoints.resume()
        if resumed is not None and trainer.step_index >= cfg.train.steps:
            if is_main:  # a rerun of a finished job: every file stays as the finished run left it
                print(already_finished(cfg, resumed.path, resumed.step), flush=True)
            return 0
        run_dir = prepare_run_dir(cfg, trainer.model_cfg, is_main=is_main)
        if is_main:
            data = f"data {cfg.data.name} ({len(trainer.dataset.split('train'))} train tokens, vocab {trainer.dataset.vocab_size})"
            lines = [data] + ([extra] if extra else [])
            if cfg.model.init_from is not None:
                lines.append(f"weights from model.init_from={cfg.model.init_from}")
            if resumed is not None:
                lines.append(f"resumed from {resumed.path} at step {resumed.step}")
            print(
                describe_run(cfg, n_params=trainer.n_params, device=trainer.device, extra="\n  ".join(lines)),
                flush=True,
            )
        rate = compute_rate(cfg, trainer.model_cfg, trainer.device, devices=trainer.world)
        backends = (  # last before the `with`, whose exit closes them
            open_backends(cfg.log, run_dir, first_step=trainer.step_index, config=dataclasses.asdict(cfg))
            if is_main
            else []
        )
        with RunLogger(
            run_dir if is_main else None,
            total_steps=cfg.train.steps,
            every=cfg.log.every,
            progress=cfg.log.progress,
            device=trainer.device,
            enabled=is_main,
            first_step=trainer.step_index,
            time_scale=cfg.emulate.time_scale if cfg.device == EMULATED_DEVICE else None,
            backends=backends,
            compute=rate,
        ) as logger:
            with stopping.deferring(cfg.checkpoint.on_signal), long_lived_heap():
                trainer.run(cfg.train.steps - trainer.step_index, logger=logger, hook=checkpoints)
            stop = stopping.pending()
            if stop is not None:  # deferred by checkpoint.on_signal: the step finished on every rank
                # still deferred: a save's collectives (shards gathered to their writer) must not take
                # the pending stop for a new one; a signal repeated after the grace still stops it
                with stopping.deferring():
                    checkpoints.save(background=False)
                    checkpoints.saver.wait()
                raise stop
            for key, value in trainer.measurements().items():
                logger.section(key, value)
            checkpoints.finish(logger)
            logger.close()
        finished = True
    except JobStopped as stop:
        drop_failure_views(stop)  # their locals hold views of shared memory that close() frees
        _stopped(trainer, logger, stop)
        raise
    except Exception as err:
        drop_failure_views(err)
        news = _failed(trainer, err)
        if isinstance(news, JobStopped):
            _stopped(trainer, logger, news)
        if news is not None:
            raise news from err
        raise
    finally:
        try:
            if checkpoints is not None:
                checkpoints.close(failing=not finished)
        finally:
            trainer.close()
            watch = peers.current()
            if watch is not None:  # the store's host keeps its stop or failure news readable
                watch.linger()
    return 0


def already_finished(cfg: SysxConfig, checkpoint: Path, step: int) -> str:
    """The one line a rerun of a finished job prints (it trains nothing and writes nothing)."""
    summary = Path(cfg.run_dir) / SUMMARY_FILE
    where = f"; its summary: {summary}" if summary.is_file() else ""
    return (
        f"sysx-train: already finished: {checkpoint} is step {step} of train.steps={cfg.train.steps}{where}; "
        "nothing was changed (raise train.steps to train on, or give another run_dir to start again)"
    )


def _stopped(trainer: Trainer, logger: RunLogger | None, stop: JobStopped) -> None:
    """Tell the other ranks (first: they may be waiting for this one), then write the summary."""
    watch = peers.current()
    # a launcher that lost a worker SIGTERMs the others: the signal's cause is that worker
    cause = watch.vanished_peer(f"step {trainer.step_index}") if watch is not None and stop.origin is None else None
    if watch is not None:
        watch.leaving(f"stopped by {stopping.signal_name(stop.signum)}")
        if cause is not None:
            watch.publish_failure(cause.failed_rank, cause.reason)
        elif stop.origin is None:
            watch.publish_stop(stop.signum)
    stopping.request(stop.signum, stop.origin)  # a second signal now is the launcher's echo, not a new stop
    stop.where = f" at step {trainer.step_index}" + (f", after {cause.reason}" if cause is not None else "")
    if logger is not None and logger.enabled:
        logger.close(stopped=stopping.signal_name(stop.signum))
        if logger.run_dir is not None:
            stop.where += f"; {logger.run_dir / SUMMARY_FILE}"


def _failed(trainer: Trainer, err: Exception) -> BaseException | None:
    """This rank failed with ``err``: the stop or failure of another rank that explains it (its
    connection broke because that rank went first), else publish this failure to the others."""
    watch = peers.current()
    line = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
    if watch is not None:
        watch.leaving(f"failed: {line}")
    if watch is None or isinstance(err, peers.PeerFailed):
        return None  # a PeerFailed came from the watch already (and names the op it interrupted)
    news = watch.explain(line)
    if isinstance(news, peers.PeerFailed):
        watch.publish_failure(news.failed_rank, news.reason)
    elif news is None:
        watch.publish_failure(trainer.rank, line)
    return news
