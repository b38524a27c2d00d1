"""The runtime's host cost on this machine: microseconds per executor op and per p2p message.

Both measure with tiny tensors, so what is left is the host's own work: the interpreter's
dispatch, the handlers' Python, the checks, the waits on the peer. :func:`measure_op_us` runs
steps of a pipeline trainer the caller built (on :func:`probe_config` of :func:`probe_model`, a
``dim``-8 Llama; this layer may not import the trainers) and divides the step's wall time by the
ops of the rank's list; it also times every op kind on its own. :func:`measure_message_us` times
tiny gloo messages between this rank and ``peer``: a ping-pong (one message in flight, the
latency), a stream of posted ``isend``/``irecv`` waited for at the end, the same stream as one
``batch_isend_irecv``, and sysx's own :class:`P2P` with and without its header.
``profiling/bench_host_overhead.py`` is the command line over them; the profiler may charge the
figures as per-op and per-message host costs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from sysx.config import EvalSection, ModelSection, OptimSection, SysxConfig, TrainSection
from sysx.dist import posted
from sysx.runtime.p2p import P2P, TransferSpec
from sysx.schedule import Message, Op, OpKind

if TYPE_CHECKING:
    from sysx.runtime.executor import Executor

MESSAGE_MODES = ("pingpong", "stream", "batched", "p2p", "p2p+verify")


def probe_model() -> ModelSection:
    """A Llama small enough that its compute is a few torch calls per layer: ``dim`` 8, 2 blocks."""
    return ModelSection(preset="tiny", dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16, max_seq_len=8)


def probe_config(model: ModelSection, *, micro_batches: int, micro_batch_size: int, seq_len: int) -> SysxConfig:
    """A CPU fp32 job config for ``model`` (no evaluation, the torch Adam backend)."""
    return SysxConfig(
        model=model,
        train=TrainSection(
            steps=1_000_000, micro_batches=micro_batches, micro_batch_size=micro_batch_size, seq_len=seq_len
        ),
        optim=OptimSection(backend="torch", warmup_steps=1),
        eval=EvalSection(every=0),
        device="cpu",
    )


class Steps(Protocol):
    """What :func:`measure_op_us` drives: a pipeline trainer (:class:`sysx.trainers.pipeline.PipelineTrainer`)."""

    executor: Executor
    ops: Sequence[Op]

    def train_step(self) -> Any:
        """Run one training step on this rank."""
        ...


def _timed_handlers(trainer: Steps, seconds: dict[str, list[float]]) -> None:
    """Wrap the executor's handlers so each op's host time lands in ``seconds[kind]``."""
    handlers = trainer.executor.handlers

    def timed(kind: OpKind, handler: Callable[[Op], None]) -> Callable[[Op], None]:
        def run(op: Op) -> None:
            t0 = time.perf_counter()
            handler(op)
            seconds.setdefault(kind.name, []).append(time.perf_counter() - t0)

        return run

    for kind, handler in list(handlers.items()):
        handlers[kind] = timed(kind, handler)


def measure_op_us(trainer: Steps, *, steps: int = 20, warmup: int = 3, per_kind: bool = True) -> dict[str, float]:
    """Host microseconds per executor op of ``trainer``'s schedule on this rank (every rank of its
    group calls it; build the trainer on :func:`probe_config` of :func:`probe_model` for tiny tensors).

    Returns ``{"op": median step wall time / ops in this rank's list, "op best": the same of the best
    step, "step_ms": the median step,
    "ops": the list's length, "<KIND>": median us of one op of that kind}`` (the kinds only with
    ``per_kind``, measured after the plain steps: their timing wrapper adds ~1 us to each op).
    """
    walls: list[float] = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        trainer.train_step()
        if i >= warmup:
            walls.append(time.perf_counter() - t0)
    step = statistics.median(walls)
    n_ops = len(trainer.ops)
    out = {"op": step / n_ops * 1e6, "op best": min(walls) / n_ops * 1e6, "step_ms": step * 1e3, "ops": float(n_ops)}
    if per_kind:
        kinds: dict[str, list[float]] = {}
        _timed_handlers(trainer, kinds)
        for _ in range(steps):
            trainer.train_step()
        out.update({k: statistics.median(v) * 1e6 for k, v in sorted(kinds.items())})
    return out


def _exchange(mode: str, rank: int, peer: int, n: int, numel: int) -> None:
    """One round of ``n`` messages of ``numel`` fp32 values: the lower rank sends, the other receives."""
    sender = rank < peer
    bufs = [torch.zeros(numel) for _ in range(n)]
    if mode == "pingpong":
        for b in bufs:  # one message each way in turn: the wait is the latency
            first, second = (dist.isend, dist.irecv) if sender else (dist.irecv, dist.isend)
            posted(first(b, peer), mode).wait()
            posted(second(b, peer), mode).wait()
    elif mode == "stream":
        post = dist.isend if sender else dist.irecv
        for work in [posted(post(b, peer), mode) for b in bufs]:
            work.wait()
    elif mode == "batched":
        kind = dist.isend if sender else dist.irecv
        for work in dist.batch_isend_irecv([dist.P2POp(kind, b, peer) for b in bufs]):
            work.wait()
    else:  # sysx's own messages, as the executor uses them: sends posted, receives waited for one by one
        p2p = P2P(rank, device=torch.device("cpu"), timeout_s=60.0, verify=mode == "p2p+verify")
        specs = [TransferSpec(Message.ACT, 0, -1, j, (numel,), torch.float32) for j in range(n)]
        if sender:
            p2p.wait_sends([p2p.isend(b, spec, peer, mode) for b, spec in zip(bufs, specs)], mode)
        else:
            for spec in specs:
                p2p.recv(spec, peer, mode)


def measure_message_us(
    peer: int, *, modes: tuple[str, ...] = MESSAGE_MODES, n: int = 64, numel: int = 8, rounds: int = 50
) -> dict[str, float]:
    """Microseconds per tiny message (``numel`` fp32 values) between this rank and ``peer``, per mode.

    ``pingpong``: half a round trip (one message in flight); ``stream``: ``n`` posted ``isend`` /
    ``irecv`` then waited for, per message; ``batched``: the same ``n`` as one ``batch_isend_irecv``;
    ``p2p`` / ``p2p+verify``: the same stream through sysx's :class:`P2P` (bounded waits, without /
    with the header of ``schedule.verify_transfers``), received one by one and the sends waited for
    together, as the executor does; each round is a fresh :class:`P2P`, so with verify every message
    of the round is a first one and carries a header.
    Medians of ``rounds`` rounds after one warm-up (``"<mode> best"``: the best round); ``peer``
    calls it with this rank as its peer.
    """
    unknown = [m for m in modes if m not in MESSAGE_MODES]
    if unknown:
        raise ValueError(f"message modes {unknown} unknown; choose from {', '.join(MESSAGE_MODES)}")
    rank = dist.get_rank()
    out: dict[str, float] = {}
    for mode in modes:
        times = []
        for i in range(rounds + 1):
            dist.barrier()
            t0 = time.perf_counter()
            _exchange(mode, rank, peer, n, numel)
            if i:
                times.append(time.perf_counter() - t0)
        per = 2 * n if mode == "pingpong" else n
        out[mode] = statistics.median(times) / per * 1e6
        out[f"{mode} best"] = min(times) / per * 1e6  # on a busy machine the best round is the steadier figure
    return out
