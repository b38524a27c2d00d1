"""One pipeline rank's runtime, built around its schedule: the parameter store, the GPU
parameter pool and gradient buffers, the rank optimizer, p2p and the executor, closed together; and the
collectives of a step's end (one all-reduce, waited for in slices, of the losses, the optimizer's
outcome, the passes' end times and a deferred stop).

Built in one go: when a part fails to build, the parts built before it are closed (shared memory
segments and optimizer threads never outlive a failed start).

With replicas (:mod:`sysx.replicas`) the rank runs its replica's copy of the schedule (its pipeline
rank's op list, messages to its replica's ranks, its own micro-batches), its optimizer steps a shard
of each owned sub-stage after the gradient reduction, and a step ends with the shard exchange.

With a spread step (:mod:`sysx.schedule.spread`) the sharers of its unit get a gloo group of their
own (:mod:`sysx.runtime.spread_sync`), and the unit's state is gathered to its owner for a save."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sysx import device as dev
from sysx import dist as sdist
from sysx import peers, stopping
from sysx.data import TokenDataset, get_batch
from sysx.data.loss_weights import LossWeights
from sysx.emulate.pacer import Pacer
from sysx.model import ModelConfig
from sysx.model.llama import LayerInit
from sysx.optim.loss_scaler import LossScaler
from sysx.optim.stage import OptimSettings
from sysx.replicas import ReplicaLayout, shard_range
from sysx.runtime.buffers import GradBuffers, ParamPool, load_places
from sysx.runtime.executor import ExecutionError, Executor, StepContext
from sysx.runtime.optimizer import RankOptimizer
from sysx.runtime.options import PipelineOptions
from sysx.runtime.p2p import P2P
from sysx.runtime.replica_sync import ReplicaGroups, exchange_shards, gather_shards
from sysx.runtime.spread_sync import spread_groups
from sysx.runtime.stage_params import StageParams
from sysx.schedule import Op, Schedule
from sysx.schedule.spread import spread_ranks
from sysx.trace import Recorder


class RankRuntime:
    """The parts of rank ``info.rank`` (see the module doc). ``settings`` makes the optimizer's
    settings from the resolved ``optim.rollback`` (``auto`` is resolved by the parameter store)."""

    def __init__(
        self,
        schedule: Schedule,
        info: sdist.DistInfo,
        opts: PipelineOptions,
        *,
        model_cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup | None,
        pacer: Pacer,
        job: str,
        seed: int,
        init: LayerInit,
        settings: Callable[[str], OptimSettings],
        scaler: LossScaler,
        micro_batch_size: int,
        seq_len: int,
        dataset: TokenDataset,
        layout: ReplicaLayout | None = None,
        micro_batches: int = 1,
    ) -> None:
        self.rank, self.world, self.group, self.timeout_s = info.rank, info.world_size, group, opts.timeout_s
        self.layout = layout or ReplicaLayout(1, info.world_size, info.rank, info.local_world_size)
        self.stage_rank, self.pacer = self.layout.stage_rank, pacer
        self.replica_groups, self.spread_groups = _groups(schedule, self.layout)  # collective: first
        self.dataset, self.seed, self.micro_batch_size, self.seq_len = dataset, seed, micro_batch_size, seq_len
        self.schedule, self.device, self.dtype, self.micro_batches = schedule, device, dtype, micro_batches
        self.local_world_size, self._closed = info.local_world_size, False
        with contextlib.ExitStack() as undo:
            self.params = StageParams(
                schedule,
                model_cfg,
                info,
                dtype=dtype,
                job=job,
                group=group,
                timeout_s=opts.timeout_s,
                seed=seed,
                init=init,
                rollback=opts.rollback,
                layout=self.layout,
                tier=settings("undo").tier,
                pin=dev.is_cuda(device),  # a device=cpu job on a GPU machine makes no CUDA context
            )
            undo.callback(self.params.close)
            self.compute, h2d, d2h = pacer.streams(device)
            self.pool = self._pool(schedule, dtype, device, h2d=h2d, compute=self.compute)
            self.grads = GradBuffers(dtype, device, compute=self.compute, d2h=d2h)
            self.optimizer = RankOptimizer(
                self.params,
                settings(self.params.rollback),
                scaler,
                group=group,
                local_rank=info.local_rank,
                local_world_size=info.local_world_size,
                pace=pacer.optimizer_pace(),
                replica_group=self.replica_groups.reduce if self.replica_groups is not None else None,
                pacer=pacer,
                spread_groups=self.spread_groups,  # each spread unit's sharers
            )
            undo.callback(self.optimizer.close)
            self.p2p = self._p2p(opts, device, pacer)
            self.executor = Executor(
                schedule,
                self.stage_rank,
                model_cfg=model_cfg,
                device=device,
                dtype=dtype,
                micro_batch_size=micro_batch_size,
                seq_len=seq_len,
                params=self.params,
                pool=self.pool,
                grads=self.grads,
                optimizer=self.optimizer,
                p2p=self.p2p,
                batch=self._batch,
                pacer=pacer,
            )
            undo.pop_all()  # built: close() releases them from now on

    def _pool(
        self,
        schedule: Schedule,
        dtype: torch.dtype,
        device: torch.device,
        *,
        h2d: dev.Stream,
        compute: dev.Stream,
    ) -> ParamPool:
        """The device parameter pool: as large as this rank's op list places its units (the plan's
        bytes, :mod:`sysx.schedule.param_pool`), and one forward stage at least (evaluation loads
        them one at a time)."""
        numels = self.params.numels
        _, placed = load_places(schedule, schedule.ops[self.stage_rank], numels)
        stages = [
            sum(numels[i] for i in schedule.partition.stage_layers(s))
            for s in schedule.assignment.fwd_stages(self.stage_rank)
        ]
        return ParamPool(max(placed, *stages), dtype, device, layer_numels=numels, h2d=h2d, compute=compute)

    eval_rows = 1  # rows of the evaluation in progress (set by loss_weights of the val split)

    @property
    def rows_per_step(self) -> int:
        """Rows of a step's global batch (every replica's micro-batches)."""
        return self.micro_batches * self.layout.replicas * self.micro_batch_size

    def _batch(self, step: int, mb: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``mb`` of ``step`` from ``split`` (the same on every rank of a replica; each
        replica its own rows: replica ``r``'s micro-batch ``mb`` is the one-replica run's ``mb*R+r``)."""
        return get_batch(
            self.dataset,
            seed=self.seed,
            step=step,
            micro_batch=mb,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            split=split,
            dp_rank=self.layout.replica,
            dp_size=self.layout.replicas,
            rows_per_step=self.rows_per_step if split == "train" else self.eval_rows,
        )

    def loss_weights(self, step: int, pieces: int, *, split: str = "train") -> LossWeights:
        """How the ``pieces`` micro-batches of ``step`` (every replica's) add up to its loss; for the val
        split ``pieces`` is the evaluation's micro-batches, whose rows its batches are cut from from now on."""
        if split != "train":
            self.eval_rows = pieces * self.micro_batch_size
        rows = self.rows_per_step if split == "train" else self.eval_rows
        return LossWeights.of_step(
            self.dataset,
            pieces=pieces,
            seed=self.seed,
            step=step,
            rows_per_step=rows,
            seq_len=self.seq_len,
            split=split,
        )

    def _p2p(self, opts: PipelineOptions, device: torch.device, pacer: Pacer) -> P2P | None:
        """This rank's messages (none in a one-rank run)."""
        if self.world == 1:
            return None
        verify = opts.verify_transfers if opts.verify_transfers is not None else dist.get_backend() != "nccl"
        # checkpoints on a communicator of their own: they overlap activations and gradients on NCCL too
        return P2P(
            self.rank,
            device=device,
            timeout_s=opts.timeout_s,
            verify=verify,
            ckpt_group=sdist.checkpoint_group(),
            pacer=pacer,
            peer_offset=self.layout.global_rank(0),
        )

    def record(self, recorder: Recorder) -> None:
        """Every part records its ops into ``recorder`` (a window of recorded steps, :mod:`sysx.trace`)."""
        for part in (self.executor, self.pool, self.grads, self.optimizer.threads, self.p2p):
            if part is not None:
                part.recorder = recorder

    def run(self, ops: Sequence[Op], ctx: StepContext) -> None:
        """Run ``ops``: a training step's owners then push updated parameters to mirror segments on
        other nodes, a forward-only program waits for its sends (it has no VALIDATE). A failure drops
        every tensor held between ops."""
        try:
            self.executor.run(ops, ctx)
            if ctx.training:
                self.exchange_shards()
                self.sharers_written()
                self.params.push_mirrors()
            else:
                self.executor.wait_sends()
        except BaseException:
            self.executor.reset()
            raise

    def sharers_written(self) -> None:
        """A spread unit mirrored on another node: its sharers meet before the owner pushes it, so
        that the push carries every shard's write: re-steps and rollbacks after the validation's
        decision (each rank waits only for its own), a checkpoint's restore."""
        for key, ranks in self.params.spread.items():
            if self.rank in ranks and self.params.units[key].mirrored:
                work = dist.barrier(group=self.spread_groups[key], async_op=True)
                what = f"the sharers of {self.params.units[key].key} done writing it, before its mirror push"
                sdist.wait_for(work, rank=self.rank, what=what, peer=None, timeout_s=self.timeout_s, collective=True)

    def exchange_shards(self) -> int:
        """The replicas' updated shards into this node's working copy (replicas on other nodes;
        collective over the replicas of this pipeline rank). Returns the bytes received."""
        if self.replica_groups is None:
            return 0
        return exchange_shards(
            self.layout,
            self.params.shared,
            [(u.stage, u.sub) for u in self.params.owned()],
            group=self.replica_groups.exchange,
            timeout_s=self.timeout_s,
            pacer=self.pacer,
        )

    def node_host_bytes(self) -> list[dict[str, int]]:
        """Each node's host optimizer bytes (:meth:`RankOptimizer.host_bytes` summed over its ranks),
        by node (collective: every rank calls it)."""
        nodes = -(-self.world // self.local_world_size)
        mine = self.optimizer.host_bytes()
        keys = sorted(mine)
        values = [0.0] * (len(keys) * nodes)
        node = self.rank // self.local_world_size
        values[node * len(keys) : (node + 1) * len(keys)] = [float(mine[k]) for k in keys]
        total = self.all_reduce(values, "host memory of the optimizers (all-reduce)")
        return [{k: int(total[n * len(keys) + i]) for i, k in enumerate(keys)} for n in range(nodes)]

    def gather_shards(self, key: tuple[int, int], shard: torch.Tensor) -> torch.Tensor | None:
        """Sub-stage ``key``'s full flat buffer from its ``shard``s: a spread step's on its owner, the
        replicas' on the first replica; None on the other holders (collective over the holders); not
        sharded: ``shard`` itself."""
        numel = self.params.units[key].numel
        ranks = self.params.spread.get(key)
        if ranks is not None:
            cuts, group, root = self.params.spread_shards(key), self.spread_groups[key], self.params.units[key].owner
        elif self.replica_groups is not None:
            ranks, group = self.layout.peers(), self.replica_groups.exchange
            cuts, root = [shard_range(numel, len(ranks), j) for j in range(len(ranks))], ranks[0]
        else:
            return shard
        return gather_shards(
            shard, cuts=cuts, ranks=ranks, root=root, rank=self.rank, group=group, timeout_s=self.timeout_s
        )

    def mean_loss(self, ctx: StepContext, what: str) -> float:
        """The mean of every rank's losses of ``ctx``, weighted as ``ctx.weights`` says (collective:
        ``what`` names the all-reduce)."""
        total, weight = self.all_reduce(ctx.loss_sums(), what)
        return total / weight

    def all_reduce(
        self, values: list[float], what: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> list[float]:
        """``values`` reduced over the ranks, waited for in slices (a stop or a dead peer interrupts it)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        try:
            work = dist.all_reduce(t, op=op, group=self.group, async_op=True)
        except RuntimeError as err:  # a peer that died before the collective was posted
            watch = peers.current()
            news = watch.explain(f"{what} could not start") if watch is not None else None
            if news is not None:
                raise news from err
            raise sdist.PeerTimeout(f"rank {self.rank}: {what} could not start: {str(err).splitlines()[0]}") from err
        sdist.wait_for(work, rank=self.rank, what=what, peer=None, timeout_s=self.timeout_s, collective=True)
        return t.tolist()

    def end_step(self, ctx: StepContext, n_micro: int, *, one_clock: bool) -> StepEnd:
        """The step's one all-reduce on every rank: losses, the optimizer's rollbacks and re-steps,
        each rank's backward and VALIDATE ends, and a stop deferred to the end of the step
        (``checkpoint.on_signal``), which travels with the loss so that every rank ends this step
        knowing it and saves and stops at the same point. ``n_micro``: the losses expected."""
        local, weight = ctx.loss_sums()
        stop = stopping.pending()
        signals = [float(stop is not None and stop.signum == s) for s in stopping.STOP_SIGNALS]
        outcome = self.optimizer.outcome
        assert outcome is not None
        times = [0.0] * (2 * self.world)  # this rank's slots only: the sum gathers every rank's
        times[2 * self.rank : 2 * self.rank + 2] = [ctx.backward_end, ctx.validate_end]
        counts = [float(len(ctx.losses)), float(outcome.undone + outcome.restepped), float(outcome.restepped)]
        total, weight, count, undone, restepped, *rest = self.all_reduce(
            [local, weight, *counts, *signals, *times], f"end of step {ctx.step} (loss all-reduce)"
        )
        stops, times = rest[: len(signals)], rest[len(signals) :]
        stopped = any(seen > 0 for seen in stops)
        for signum, seen in zip(stopping.STOP_SIGNALS, stops):
            if seen > 0:
                stopping.request(signum)
                break
        if int(count) != n_micro:
            raise ExecutionError(
                f"rank {self.rank}: step {ctx.step}: {int(count)} micro-batch losses were computed, expected {n_micro}"
            )
        exposed = exposed_seconds(times[0::2], times[1::2], one_clock=one_clock)
        return StepEnd(total / weight, int(undone), int(restepped), exposed, stopped)

    def master_state(self) -> dict[str, torch.Tensor]:
        """The full fp32 weights by parameter name; collective: every rank calls it and gets the same
        dict (gathered over the CPU group, meant for tests and small models)."""
        current = {key: stage.master_copy() for key, stage in self.optimizer.stages.items()}
        # the first replica (a spread unit's owner) holds every shard: it answers for them
        full = {key: self.gather_shards(key, t) for key, t in current.items()}
        current = {key: t for key, t in full.items() if t is not None}
        mine = self.params.master_state(current) if current or self.replica_groups is None else {}
        if self.world == 1:
            return mine
        parts: list[dict[str, torch.Tensor] | None] = [None] * self.world
        dist.all_gather_object(parts, mine, group=self.group)
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update(part or {})
        return dict(sorted(out.items(), key=lambda kv: (int(kv[0].split(".")[1]), kv[0])))

    def close(self) -> None:
        """Join optimizer threads, drop every view of shared memory and close the store (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.executor.close()
        self.optimizer.close()
        self.params.close()


def _groups(
    schedule: Schedule, layout: ReplicaLayout
) -> tuple[ReplicaGroups | None, dict[tuple[int, int], dist.ProcessGroup]]:
    """The replicas' groups of every pipeline rank (None: one replica) and the sharers' group of each
    spread unit (collective over the job: every rank creates each, in one order)."""
    replicas = ReplicaGroups.build(layout) if layout.replicas > 1 else None
    base = layout.global_rank(0)
    spread = {unit: [base + r for r in ranks] for unit, ranks in spread_ranks(schedule).items()}
    return replicas, spread_groups(spread) if spread else {}


def exposed_seconds(backward_ends: list[float], validate_ends: list[float], *, one_clock: bool) -> float:
    """The optimizer time of a step no compute hid: from the end of the last backward on any rank
    to the end of the last VALIDATE (optimizer jobs, all-reduce, rollbacks, re-steps). Ranks on one
    node share ``time.monotonic()``; across nodes the clocks differ, so the smallest per-rank span
    is taken (every rank's VALIDATE ends after the all-reduce that waits for the last backward)."""
    if one_clock:
        return max(0.0, max(validate_ends) - max(backward_ends))
    return max(0.0, min(v - b for b, v in zip(backward_ends, validate_ends)))


@dataclass
class StepEnd:
    """What the ranks agreed on at the end of a step (:meth:`RankRuntime.end_step`)."""

    loss: float  # mean over every micro-batch of every rank
    undone: int  # the step's rollbacks (clipping re-steps included)
    restepped: int  # its clipping re-steps
    exposed_s: float  # optimizer time no compute hid (:func:`exposed_seconds`, wall seconds)
    stopped: bool = False  # a stop deferred to the end of the step: every rank knows it now
