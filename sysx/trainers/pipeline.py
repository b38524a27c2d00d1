"""``PipelineTrainer``: every pipeline schedule, one process per device, as a library and as a job.

Library use mirrors :class:`sysx.trainers.reference.ReferenceTrainer`::

    trainer = PipelineTrainer(cfg, PipelineOptions(schedule="sysx", split=2))  # on every rank
    results = trainer.run(steps)           # one StepResult per step, the same on every rank
    weights = trainer.state_dict()         # collective: the full fp32 weights on every rank
    trainer.close()

The job (``schedule=gpipe|1f1b|interleaved_1f1b|mobius|sysx`` under torchrun or mpirun) is :func:`train`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from sysx import device as dev
from sysx import dist as sdist
from sysx import peers
from sysx.checkpoint import Checkpoint
from sysx.checkpoint.flat_state import flat_layer_states
from sysx.checkpoint.saver import LayerSource
from sysx.config import ConfigError, SysxConfig, resolve
from sysx.config.choices import EMULATED_DEVICE
from sysx.emulate.device_model import device_model
from sysx.memory import drop_failure_views, resolve_job_id, torch_broadcast
from sysx.metrics import StepResult
from sysx.optim.speculate import SpeculationPolicy
from sysx.partition import unit_label
from sysx.replicas import ReplicaLayout
from sysx.runtime.executor import ExecutionError, StepContext
from sysx.runtime.optimizer import OptimSettings
from sysx.runtime.optimizer_placement import place_optimizer
from sysx.runtime.options import PipelineOptions, make_schedule, options_from_config
from sysx.runtime.p2p import TransferMismatch
from sysx.runtime.rank import RankRuntime
from sysx.schedule import Schedule, evaluation_schedule, validate
from sysx.schedule.costs import Costs
from sysx.schedule.spread import spread_ranks
from sysx.trainers.base import Trainer, job_device
from sysx.trainers.checkpointing import restore_stage_from, stage_layer_sources
from sysx.trainers.job import run_job
from sysx.trainers.observation import PipelineObservation
from sysx.trainers.prediction import release_free_heap, start_host_peak

if TYPE_CHECKING:
    from sysx.data import TokenDataset

_instances = itertools.count()


class PipelineTrainer(Trainer):
    """One rank of a pipeline-parallel run (see docs/architecture.md). Every rank constructs it with the
    same ``cfg`` and ``options``; without ``info`` the process group is joined from the
    launcher's environment (a single process needs none). ``tuned_costs``: what ``schedule.tune``
    predicted this run with (rank 0), the costs its prediction is checked with."""

    def __init__(
        self,
        cfg: SysxConfig | DictConfig,
        options: PipelineOptions | None = None,
        *,
        info: sdist.DistInfo | None = None,
        dataset: TokenDataset | None = None,
        device: torch.device | str | None = None,
        tuned_costs: Costs | None = None,
    ) -> None:
        super().__init__(cfg, dataset=dataset, device=device)
        cfg, t = self.cfg, self.cfg.train
        self.opts = options if options is not None else options_from_config(cfg)
        self.opts.check()
        self.info = info if info is not None else sdist.init(timeout_s=self.opts.timeout_s, device=cfg.device)
        self.rank, self.world = self.info.rank, self.info.world_size
        if self.world > 1 and not torch.distributed.is_initialized():
            raise RuntimeError(
                f"rank {self.rank}: {self.world} processes but no process group; call sysx.dist.init() first"
            )
        self.device = job_device(cfg, device)
        self.group = sdist.cpu_group() if self.world > 1 else None
        if self.group is not None:  # each rank resolved run_dir's ${now:...} at its own start: rank 0's counts
            run_dir = torch_broadcast(self.group)(cfg.run_dir)
            if run_dir != cfg.run_dir:
                self.cfg = cfg = dataclasses.replace(cfg, run_dir=run_dir)
        self.layout = replica_layout(cfg, self.info)
        build = functools.partial(
            make_schedule,
            self.opts,
            n_ranks=self.layout.pipeline,
            n_micro=t.micro_batches,
            micro_batch_size=t.micro_batch_size,
            ranks_per_node=ranks_per_node(cfg, self.info),
            spread_allowed=self.layout.replicas == 1 and cfg.optim.offload == "host",
        )
        self.device_model = device_model(  # real or emulated: the trainer asks it, never the kind
            cfg,
            self.model_cfg,
            build,
            rank=self.rank,
            group=self.group,
            world=self.world,
            backend=self.opts.optim_backend,
            layout=self.layout,
        )
        self.schedule, self.pacer = self.device_model.schedule, self.device_model.pacer
        self.ops = self.schedule.ops[self.layout.stage_rank]
        broadcast = torch_broadcast(self.group) if self.world > 1 else None
        self.job_id = f"{self.opts.job_id or resolve_job_id(rank=self.rank, broadcast=broadcast)}.t{next(_instances)}"
        release_free_heap()  # what rank 0's tuning freed is not this run's: out of the baseline, as on every rank
        # before the training state exists: its growth is what the plan describes
        rss0 = start_host_peak(self.opts.optim_backend)
        self.runtime = self._rank_runtime()
        self.params, self.optimizer, self.executor = self.runtime.params, self.runtime.optimizer, self.runtime.executor
        self._closed = False
        self._stop_agreed = False  # the last step's all-reduce carried a stop (stop_agreed)
        try:
            o = cfg.optim
            placed = place_optimizer(
                self.runtime,
                self.device_model,
                mode=o.placement,
                backend=self.opts.optim_backend,
                speculative=o.speculate != "never",
            )
            self.placement, self.placement_ranks = placed.placement, placed.section  # ranks: summary.json
            self._eval = self._evaluation(max(1, self.layout.turns(cfg.eval.batches)))
            self.host_memory = self._host_memory()  # summary.json's host_memory
            self.observation = PipelineObservation(cfg, self.runtime, self.device_model, tuned=tuned_costs, rss0=rss0)
        except BaseException:
            self.close()
            raise
        self.window, self.prediction = self.observation.window, self.observation.prediction

    def _rank_runtime(self) -> RankRuntime:
        """This rank's parameter store, buffers, optimizer, p2p and executor (:mod:`sysx.runtime.rank`)."""
        return RankRuntime(
            self.schedule,
            self.info,
            self.opts,
            model_cfg=self.model_cfg,
            dtype=self.dtype,
            device=self.device,
            group=self.group,
            pacer=self.pacer,
            job=self.job_id,
            seed=self.cfg.seed,
            init=self.layer_init(),
            settings=self._optim_settings,
            scaler=self.scaler,
            micro_batch_size=self.cfg.train.micro_batch_size,
            seq_len=self.cfg.train.seq_len,
            dataset=self.dataset,
            layout=self.layout,
            micro_batches=self.cfg.train.micro_batches,
        )

    def _optim_settings(self, rollback: str) -> OptimSettings:
        """The rank optimizer's settings (``rollback``: ``optim.rollback`` resolved by the parameter store)."""
        o, opts = self.cfg.optim, self.opts
        settings = OptimSettings.from_config(
            o, backend=opts.optim_backend, rollback=rollback, workers=opts.optimizer_workers
        )
        return dataclasses.replace(settings, **self.device_model.optimizer_settings(rollback))

    def _evaluation(self, n_micro: int) -> Schedule:
        """The validated forward-only program over ``n_micro`` micro-batches."""
        program = evaluation_schedule(self.schedule, n_micro)
        validate(program)
        return program

    @property
    def n_params(self) -> int:
        """Parameters of the whole model."""
        return sum(self.params.numels)

    # ------------------------------------------------------------------------------------- steps
    def train_step(self) -> StepResult:
        """Run one step of the schedule on this rank; returns the step's result (same on every rank)."""
        if self._closed:
            raise RuntimeError("PipelineTrainer.train_step after close()")
        step = self.step_index
        t0 = time.perf_counter()
        watch = peers.current()
        if watch is not None:
            watch.doing(f"step {step}")
        scale = float(self.scaler.scale)
        lr = self.lr_at(step)
        self.optimizer.begin()
        self.pacer.begin_step(step)
        n_micro = self.cfg.train.micro_batches * self.layout.replicas
        ctx = StepContext(
            step=step,
            lr=lr,
            scale=scale,
            n_micro=self.cfg.train.micro_batches,
            replicas=self.layout.replicas,
            weights=self.runtime.loss_weights(step, n_micro),
        )
        self.window.begin(step)
        try:
            self.runtime.run(self.ops, ctx)
        finally:
            self.window.end()
        end = self.runtime.end_step(ctx, n_micro, one_clock=self.info.num_nodes == 1)
        self._stop_agreed = end.stopped
        dev.synchronize(self.device)
        outcome = self.optimizer.outcome
        assert outcome is not None
        result = StepResult(
            step=step,
            loss=end.loss,
            lr=lr,
            grad_norm=outcome.grad_norm,
            skipped=outcome.skipped,
            scale=scale,
            tokens=self.tokens_per_step,
            step_time_s=self.pacer.end_step(time.perf_counter() - t0),
            speculated=self.schedule.options.async_optimizer and self.optimizer.speculating,
            rolled_back=end.undone,
            restepped=end.restepped,
            opt_exposed_s=end.exposed_s / self.pacer.time_scale,
        )
        if self.schedule.options.async_optimizer and not result.speculated:
            self.device_model.validated_first.add(step)
        self.observation.after_step(result)
        self.step_index += 1
        return result

    def measurements(self) -> dict[str, Any]:
        """``{"measured": ..., "plan": ...}`` of the recorded window on rank 0, once written (else
        empty), the ``prediction`` and ``placement``; on an emulated device also its ``emulation``
        report (collective then: every rank calls it)."""
        out = self.observation.sections()
        out["host_memory"] = self.host_memory
        if self.placement_ranks:
            out["placement"] = self.placement_ranks
        out.update(self.device_model.sections())
        return out

    def _host_memory(self) -> dict[str, Any]:
        """Host bytes of the optimizers on each node, measured (the buffers they hold, all made by
        now) beside the node plan of this rank's node (collective: every rank calls it)."""
        plan = self.params.node_plan(self.params.rollback, self.params.offload)
        return {
            "replicas": self.layout.replicas,
            "measured_per_node": self.runtime.node_host_bytes(),
            "plan_this_node": {
                "master": plan.master,
                "optimizer": plan.optimizer,
                "grads": plan.grads,
                "pinned": plan.pinned,
                "shared": plan.shared,
            },
        }

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> float:
        """Mean loss over ``eval.batches`` micro-batches of the val split (forward-only program),
        the replicas taking turns: replica ``r`` runs micro-batches ``r, r+R, ...`` of them."""
        n = self.layout.turns(self.cfg.eval.batches if batches is None else batches)
        total = self.cfg.eval.batches if batches is None else batches
        ctx = StepContext(
            step=0, n_micro=n, split="val", training=False, weights=self.runtime.loss_weights(0, total, split="val")
        )
        if n:  # more replicas than micro-batches: this one adds nothing to the all-reduce
            program = self._eval if n == self._eval.n_micro else self._evaluation(n)
            self.pacer.begin_step(self.step_index, record=False)
            self.runtime.run(program.ops[self.layout.stage_rank], ctx)
        return self.runtime.mean_loss(ctx, "evaluation (loss all-reduce)")

    def stop_agreed(self) -> bool:
        """Whether the last step's all-reduce carried the pending stop: a signal after it is carried
        by the next step's, so that every rank ends the loop after the same step (its save's
        collectives pair up)."""
        return self._stop_agreed or self.world == 1

    @property
    def job_tag(self) -> str:
        """The job id every rank shares (it names the checkpoint saves too)."""
        return self.job_id

    def checkpoint_layers(self) -> dict[int, LayerSource]:
        """The layers of the sub-stages this rank owns (their masters, moments and step counts);
        with replicas the first replica writes them, gathered from every replica's shards
        (collective), and a spread step's owner writes its unit, gathered from the sharers, so a
        checkpoint is keyed by layers whatever the layout."""
        out: dict[int, LayerSource] = {}
        for key, stage in self.optimizer.stages.items():
            layers = list(self.params.units[key].layers)
            if self.layout.replicas == 1 and key not in self.params.spread:
                out.update(stage_layer_sources(stage, self.params.layout(key), layers))
                continue
            adam = stage.optimizer
            with stage.resident():  # the NVMe tier: the shard's state read while it is gathered
                full = [self.runtime.gather_shards(key, t) for t in (adam.param, adam.exp_avg, adam.exp_avg_sq)]
            master, exp_avg, exp_avg_sq = full
            if master is not None and exp_avg is not None and exp_avg_sq is not None:
                out.update(
                    flat_layer_states(
                        self.params.layout(key),
                        layers,
                        master,
                        exp_avg,
                        exp_avg_sq,
                        functools.partial(int, adam.step_count),
                    )
                )
        return out

    def restore_layers(self, ckpt: Checkpoint) -> None:
        """The owned sub-stages from ``ckpt`` (whatever schedule and rank count wrote it), then the
        owners push the new values to mirrors on other nodes (every rank calls this)."""
        for key, stage in self.optimizer.stages.items():
            indices = list(self.params.units[key].layers)
            unit = self.params.units[key]
            shard = self.params.shard(unit) if self.layout.replicas > 1 or key in self.params.spread else None
            restore_stage_from(stage, self.params.layout(key), indices, ckpt, shard=shard)
        self.runtime.exchange_shards()
        self.runtime.sharers_written()  # a spread unit's shards all restored before its mirror push
        self.params.push_mirrors()
        self.params.barrier("checkpoint restore barrier")  # no rank reads a segment before its owner rewrote it

    def speculation_policy(self) -> SpeculationPolicy | None:
        """The rank optimizer's policy (every rank's is the same: they record one all-reduced outcome)."""
        return self.optimizer.policy

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 weights by parameter name (``layers.<i>.<name>``); collective: every rank
        calls it and gets the same dict (gathered over the CPU group, meant for tests and small models)."""
        return self.runtime.master_state()

    def describe(self) -> str:
        """The plan of this run: schedule and options, partition, and which rank runs what."""
        sch = self.schedule
        lines = [
            f"pipeline: {self.opts.describe()} | {self.world} rank(s) on {self.info.num_nodes} node(s) | "
            f"Nsf={sch.n_stages} d={sch.split} Nm={sch.n_micro} | ckpt {sch.options.ckpt} | "
            f"optimizer {sch.options.optimizer}{_spread_words(sch)} | job {self.job_id}",
            *(
                ["  " + self.layout.describe() + f", gradients reduced over the {self.layout.reduction}"]
                if self.layout.replicas > 1
                else []
            ),
            *("  " + line for line in sch.partition.describe().splitlines()),
            *("  " + line for line in sch.assignment.describe()),
            *self.device_model.describe(),
        ]
        return "\n".join(lines)

    def close(self) -> None:
        """Join optimizer threads, drop every view of shared memory and close the store (idempotent).
        Called on the way out of a failure, it first clears the failure's frames (:func:`drop_failure_views`)."""
        drop_failure_views()
        self._closed = True
        self.runtime.close()


def _spread_words(schedule: Schedule) -> str:
    """`` (last step shared by ranks 4-7)`` when the schedule spreads its last optimizer step."""
    return "".join(
        f" (last step of {unit_label(*unit)} shared by ranks {ranks[0]}-{ranks[-1]})"
        for unit, ranks in spread_ranks(schedule).items()
    )


def ranks_per_node(cfg: SysxConfig, info: sdist.DistInfo) -> int:
    """Ranks to a node of the cluster the job runs on: the emulated cluster's GPUs per node on an
    emulated device (its ranks all run here), else this node's processes."""
    if cfg.device == EMULATED_DEVICE:
        from sysx.emulate.profiles import cluster

        return cluster(cfg.emulate).gpus_per_node
    return info.local_world_size


def replica_layout(cfg: SysxConfig, info: sdist.DistInfo) -> ReplicaLayout:
    """The job's ``parallel.replicas`` over its processes; a layout it cannot run is one line."""
    try:
        layout = ReplicaLayout.of(
            cfg.parallel.count, info.world_size, rank=info.rank, local_world_size=info.local_world_size
        )
        _ = layout.reduction  # refuses a layout whose replicas both share and do not share nodes
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return layout


# ----------------------------------------------------------------------------------------- jobs
def train(cfg: SysxConfig, info: sdist.DistInfo) -> int:
    """The ``sysx-train`` job for a pipeline schedule (every rank runs it). Returns the exit status:
    0, or 1 after a runtime failure (a lost peer, a timeout, a plan mismatch), printed by every rank."""
    from sysx.optim.cores import apply_plan, bind_choice, bind_to, pinning, plan_cores

    opts = options_from_config(cfg)
    info = sdist.init(timeout_s=opts.timeout_s, device=cfg.device)
    try:
        tuned_costs = None
        bind, why = bind_choice(cfg.parallel.bind_cores, local_world_size=info.local_world_size, device=cfg.device)
        if bind:  # before the tune, so its profile is measured on the cores the run keeps
            bind_to(plan_cores(n_stages=1, local_rank=info.local_rank, local_world_size=info.local_world_size))
        if cfg.schedule.tune:  # the choice goes into the config, so run_dir/config.yaml records it
            from sysx.autotune.apply import tune_job

            tuned = tune_job(cfg, info, dev.resolve_device(cfg.device))
            cfg, tuned_costs = tuned.cfg, tuned.costs
            opts = options_from_config(cfg)
        plan = plan_cores(
            n_stages=1,
            backend=opts.optim_backend,
            local_rank=info.local_rank,
            local_world_size=info.local_world_size,
        )
        apply_plan(plan, bind=bind, why=why)
        trainer = PipelineTrainer(resolve(cfg), opts, info=info, tuned_costs=tuned_costs)
        cores = f"  cores: {plan.describe()}, {pinning(bind, why)}"
        status = run_job(trainer, is_main=info.is_main, extra=f"{trainer.describe()}\n{cores}")
        if status == 0 and info.world_size > 1:
            # no rank tears its process groups down while another still talks to it (the replicas'
            # last gather of the final save): gloo aborts a process whose peer vanished mid-operation
            work = torch.distributed.barrier(group=sdist.cpu_group(), async_op=True)
            sdist.wait_for(
                work,
                rank=info.rank,
                what="end of the job (barrier)",
                peer=None,
                timeout_s=opts.timeout_s,
                collective=True,
            )
        return status
    except (ExecutionError, sdist.PeerTimeout, TransferMismatch) as err:
        print(f"sysx-train: rank {info.rank}: error: {err}", file=sys.stderr, flush=True)
        watch = peers.current()
        if watch is not None and isinstance(err, peers.PeerFailed):
            watch.await_report(err.failed_rank)  # the failed rank names its own error first
        return 1
    finally:
        sdist.shutdown()
