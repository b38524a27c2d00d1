"""``PipelineTrainer``: every pipeline schedule, one process per device, as a library and as a job.

Library use mirrors :class:`sysx.trainers.reference.ReferenceTrainer`::

    trainer = PipelineTrainer(cfg, PipelineOptions(schedule="sysx", split=2))  # on every rank
    results = trainer.run(steps)           # one StepResult per step, the same on every rank
    weights = trainer.state_dict()         # collective: the full fp32 weights on every rank
    trainer.close()

One step on one rank: the executor runs the rank's op list (parameters from the shared store,
forward/backward with checkpoints, p2p, gradient offload, CPU optimizer, VALIDATE); then owners
push updated parameters to mirror segments on other nodes; then one all-reduce of the loss
ends the step on every rank, so no rank loads parameters of the next step before every
optimizer (including rollbacks and clipping re-steps) of this one has finished.

The job (``schedule=gpipe|1f1b|interleaved_1f1b|mobius|sysx`` under torchrun or mpirun) is
:func:`train`.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from sysx import device as dev
from sysx import dist as sdist
from sysx import peers, stopping
from sysx.checkpoint import Checkpoint
from sysx.checkpoint.saver import LayerSource
from sysx.config import ConfigError, SysxConfig, resolve
from sysx.config.choices import EMULATED_DEVICE
from sysx.emulate import EmulatedPacer, Pacer, describe, emulated_model, merge_report, plan_emulation
from sysx.emulate.costs import device_lane_plan
from sysx.memory import resolve_job_id, torch_broadcast
from sysx.metrics import StepResult
from sysx.optim.device_lane import DeviceLane
from sysx.optim.placement import Placement, summarize
from sysx.optim.speculate import SpeculationPolicy
from sysx.partition import unit_label
from sysx.runtime.buffers import GradBuffers, ParamSlots
from sysx.runtime.executor import ExecutionError, Executor, StepContext
from sysx.runtime.lanes import gather_placements, lane_times, placement_section, rank_placement
from sysx.runtime.optimizer import OptimSettings, RankOptimizer
from sysx.runtime.options import PipelineOptions, make_schedule, options_from_config
from sysx.runtime.p2p import P2P, TransferMismatch
from sysx.runtime.stage_params import StageParams
from sysx.schedule import CostTable, OpKind, Schedule, evaluation_schedule, validate, validate_first
from sysx.schedule.costs import Costs
from sysx.trace.report import gather_parts, write_report
from sysx.trace.window import StepWindow
from sysx.trainers.base import Trainer
from sysx.trainers.checkpointing import restore_stage, stage_layer_sources
from sysx.trainers.job import run_job
from sysx.trainers.prediction import RunPrediction

if TYPE_CHECKING:
    from sysx.data import TokenDataset

_instances = itertools.count()


class PipelineTrainer(Trainer):
    """One rank of a pipeline-parallel run (see the module doc). Every rank constructs it with the
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
        cfg = self.cfg
        self.opts = options if options is not None else options_from_config(cfg)
        self.opts.check()
        self.info = info if info is not None else sdist.init(timeout_s=self.opts.timeout_s, device=cfg.device)
        self.rank, self.world = self.info.rank, self.info.world_size
        if self.world > 1 and not dist.is_initialized():
            raise RuntimeError(
                f"rank {self.rank}: {self.world} processes but no process group; call sysx.dist.init() first"
            )
        try:
            self.device = dev.resolve_device(cfg.device) if device is None else torch.device(device)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        t = cfg.train
        # an emulated run is cut like the model it emulates (same layer count), as `sysx plan` cuts it
        cut, seq_len = self.model_cfg, t.seq_len
        if cfg.device == EMULATED_DEVICE:
            emulated = emulated_model(cfg)
            cut, seq_len = emulated.config, emulated.seq_len
        self.schedule = make_schedule(self.opts, cut, n_ranks=self.world, n_micro=t.micro_batches, seq_len=seq_len)
        self.group = sdist.cpu_group() if self.world > 1 else None
        self.pacer = self._pacer()
        self.ops = self.schedule.ops[self.rank]
        self._closed = False
        self.params: StageParams | None = None
        self.optimizer: RankOptimizer | None = None
        self.last_op_seconds: dict[str, float] = {}
        self._measurements: dict[str, dict[str, float]] = {}
        self.tuned_costs = tuned_costs
        self.placement_ranks: dict[str, Any] = {}  # every rank's optim.placement split (summary.json)
        self.lane_plan: tuple[float, float] | None = None  # emulated plan with the device lane
        self.validated_first: set[int] = set()  # steps whose optimizer stepped after VALIDATE (no speculation)
        self._validate_first: tuple[Schedule, tuple[float, float] | None] | None = None  # its program and plan
        self.window_costs: CostTable | None = None  # the recorded window's own costs, once written
        rss0 = dev.host_rss_bytes()  # before the training state exists: its growth is what the plan describes
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.prediction = RunPrediction(self, tuned_costs, rss0=rss0)

    def _pacer(self) -> Pacer:
        """The emulated device's pacer (its plan refuses a GPU memory overflow), else none."""
        if self.cfg.device != EMULATED_DEVICE:
            return Pacer()
        plan = plan_emulation(self.cfg, self.schedule, backend=self.opts.optim_backend)
        return EmulatedPacer(
            plan, self.schedule, self.rank, time_scale=self.cfg.emulate.time_scale, group=self.group, world=self.world
        )

    def _build(self) -> None:
        cfg, opts, t = self.cfg, self.opts, self.cfg.train
        base = opts.job_id or resolve_job_id(
            rank=self.rank, broadcast=torch_broadcast(self.group) if self.world > 1 else None
        )
        self.job_id = f"{base}.t{next(_instances)}"
        self.params = StageParams(
            self.schedule,
            self.model_cfg,
            self.info,
            dtype=self.dtype,
            job=self.job_id,
            group=self.group,
            timeout_s=opts.timeout_s,
            seed=cfg.seed,
            init=self.layer_init(),
            rollback=opts.rollback,
        )
        if isinstance(self.pacer, EmulatedPacer):
            self.pacer.rollback = self.params.rollback  # what an undo costs there (optim.rollback=auto resolved)
        compute, h2d, d2h = self.pacer.streams(self.device)
        loads = [self.schedule.layers(op) for op in self.ops if op.kind == OpKind.LOAD_PARAMS]
        loads += [self.schedule.partition.stage_layers(s) for s in self.schedule.placement.fwd_stages(self.rank)]
        numels = self.params.numels
        slot_numel = max(sum(numels[i] for i in r) for r in loads)
        self.slots = ParamSlots(
            self.schedule.options.param_buffers,
            slot_numel,
            self.dtype,
            self.device,
            layer_numels=numels,
            h2d=h2d,
            compute=compute,
        )
        self.grads = GradBuffers(self.dtype, self.device, compute=compute, d2h=d2h)
        settings = OptimSettings.from_config(
            cfg.optim, backend=opts.optim_backend, rollback=self.params.rollback, workers=opts.optimizer_workers
        )
        if isinstance(self.pacer, EmulatedPacer):  # the emulated workers; their real work is small: one thread each
            settings = dataclasses.replace(settings, workers=self.pacer.plan.optimizer_workers, threads_per_worker=1)
        self.optimizer = RankOptimizer(
            self.params,
            settings,
            self.scaler,
            group=self.group,
            local_rank=self.info.local_rank,
            local_world_size=self.info.local_world_size,
            pace=self.pacer.optimizer_pace(),
        )
        self.placement = self._place_optimizer()
        p2p = None
        if self.world > 1:
            backend = dist.get_backend()
            verify = opts.verify_transfers if opts.verify_transfers is not None else backend != "nccl"
            # checkpoints on a communicator of their own: they overlap activations and gradients on NCCL too
            p2p = P2P(
                self.rank,
                device=self.device,
                timeout_s=opts.timeout_s,
                verify=verify,
                ckpt_group=sdist.checkpoint_group(),
                pacer=self.pacer,
            )
        self.p2p = p2p
        self.executor = Executor(
            self.schedule,
            self.rank,
            model_cfg=self.model_cfg,
            device=self.device,
            dtype=self.dtype,
            micro_batch_size=t.micro_batch_size,
            seq_len=t.seq_len,
            params=self.params,
            slots=self.slots,
            grads=self.grads,
            optimizer=self.optimizer,
            p2p=p2p,
            batch=self._batch,
            pacer=self.pacer,
        )
        self._eval = self._evaluation(cfg.eval.batches)
        self.window = StepWindow(cfg.profile, self.device, self.rank, compute=compute, announce=self.rank == 0)
        if self.window.recorder is not None:
            for part in (self.executor, self.slots, self.grads, self.optimizer.threads, p2p):
                if part is not None:
                    part.recorder = self.window.recorder

    def _place_optimizer(self) -> Placement:
        """``optim.placement``: which owned sub-stages step on the device lane (:mod:`sysx.runtime.lanes`).
        Every rank's choice is gathered: rank 0 prints one line with the predicted saving, the
        per-rank detail goes to ``summary.json`` (``placement``), and on an emulated device the plan
        the run is compared with takes the device lane in (:func:`device_lane_plan`)."""
        assert self.optimizer is not None
        o = self.cfg.optim
        plan = self.pacer.plan if isinstance(self.pacer, EmulatedPacer) else None
        placement, units = rank_placement(
            o.placement,
            self.schedule,
            self.rank,
            {k: s.numel for k, s in self.optimizer.stages.items()},
            device=self.device,
            dtype=self.dtype,
            workers=self.optimizer.threads.workers,
            backend=self.opts.optim_backend,
            speculative=o.speculate != "never",
            plan=plan,
        )
        if placement.device:
            keys = {unit_label(*k): k for k in self.optimizer.stages}
            lane = DeviceLane(None if plan is not None else self.device)  # emulated: the host steps, the pacer times it
            self.optimizer.use_device_lane(
                {keys[n]: placement.device_times[n] for n in placement.device}, lane, self.pacer
            )
        modelled = plan is not None or dev.is_cuda(self.device)  # auto on a CPU device: no second lane to model
        if o.placement == "cpu" or (o.placement == "auto" and not (self.schedule.options.async_optimizer and modelled)):
            return placement  # nothing to say or to gather: every rank keeps the CPU lane (asked, synchronous, or no device)
        ranks = gather_placements((placement, units), world=self.world, group=self.group)
        self.placement_ranks = placement_section(ranks, o.placement)
        if plan is not None and any(p.device for p, _ in ranks):
            self.lane_plan = device_lane_plan(plan, self.schedule, lane_times(self.schedule, ranks))
        if self.rank == 0 and any(p.device or p.cpu_finish > 0 for p, _ in ranks):
            more = "; per rank: summary.json (placement)" if self.world > 1 else ""
            print(f"optim.placement={o.placement}: {summarize(ranks, 'sub-stage')}{more}", flush=True)
        return placement

    def plan_schedule(self, steps: Sequence[int]) -> Schedule:
        """The program the plan beside ``steps`` simulates: this schedule, or, when at least half of
        them validated before stepping (``optim.speculate``: after a clipped or overflowed step), the
        same schedule with a synchronous optimizer (:func:`sysx.schedule.validate_first`)."""
        if not steps or 2 * len(self.validated_first.intersection(steps)) < len(steps):
            return self.schedule
        if self._validate_first is None:
            self._validate_first = (validate_first(self.schedule), None)
        return self._validate_first[0]

    def planned(self, steps: Sequence[int] = ()) -> tuple[float, float]:
        """The emulated plan's (iteration, bubble ratio) for ``steps`` (:meth:`plan_schedule`): with
        the device lane when units are on it and the steps speculated."""
        assert isinstance(self.pacer, EmulatedPacer)
        schedule = self.plan_schedule(steps)
        if schedule is self.schedule:
            t = self.pacer.plan.timeline
            return self.lane_plan or (t.iteration, t.bubble_ratio)
        assert self._validate_first is not None
        if self._validate_first[1] is None:
            t = plan_emulation(self.cfg, schedule, backend=self.opts.optim_backend).timeline
            self._validate_first = (schedule, (t.iteration, t.bubble_ratio))
        return self._validate_first[1]

    # ------------------------------------------------------------------------------------ pieces
    def _evaluation(self, n_micro: int) -> Schedule:
        """The validated forward-only program over ``n_micro`` micro-batches."""
        program = evaluation_schedule(self.schedule, n_micro)
        validate(program)
        return program

    @property
    def n_params(self) -> int:
        """Parameters of the whole model."""
        assert self.params is not None
        return sum(self.params.numels)

    def _batch(self, step: int, mb: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        from sysx.data import get_batch

        t = self.cfg.train
        return get_batch(
            self.dataset,
            seed=self.cfg.seed,
            step=step,
            micro_batch=mb,
            micro_batch_size=t.micro_batch_size,
            seq_len=t.seq_len,
            split=split,
        )

    def _all_reduce(
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
        sdist.wait_for(work, rank=self.rank, what=what, peer=None, timeout_s=self.opts.timeout_s, collective=True)
        return t.tolist()

    # ------------------------------------------------------------------------------------- steps
    def train_step(self) -> StepResult:
        """Run one step of the schedule on this rank; returns the step's result (same on every rank)."""
        if self._closed:
            raise RuntimeError("PipelineTrainer.train_step after close()")
        assert self.optimizer is not None and self.params is not None
        step = self.step_index
        t0 = time.perf_counter()
        watch = peers.current()
        if watch is not None:
            watch.doing(f"step {step}")
        scale = float(self.scaler.scale)
        lr = self.lr_at(step)
        self.optimizer.begin()
        self.pacer.begin_step(step)
        ctx = StepContext(step=step, lr=lr, scale=scale, n_micro=self.cfg.train.micro_batches)
        self.window.begin(step)
        try:
            self.executor.run(self.ops, ctx)
            self.params.push_mirrors()
        except BaseException:
            self.executor.reset()
            raise
        finally:
            self.window.end()
        local = float(torch.stack(ctx.losses).sum()) if ctx.losses else 0.0
        # a stop deferred to the end of the step (checkpoint.on_signal) travels with the loss, so
        # that every rank ends this step knowing it and saves and stops at the same point
        stop = stopping.pending()
        signals = [float(stop is not None and stop.signum == s) for s in stopping.STOP_SIGNALS]
        outcome = self.optimizer.outcome
        assert outcome is not None
        times = [0.0] * (2 * self.world)  # this rank's slots only: the sum gathers every rank's
        times[2 * self.rank : 2 * self.rank + 2] = [ctx.backward_end, ctx.validate_end]
        total, count, undone, restepped, *rest = self._all_reduce(
            [
                local,
                float(len(ctx.losses)),
                float(outcome.undone + outcome.restepped),
                float(outcome.restepped),
                *signals,
                *times,
            ],
            f"end of step {step} (loss all-reduce)",
        )
        stops, times = rest[: len(signals)], rest[len(signals) :]
        for signum, seen in zip(stopping.STOP_SIGNALS, stops):
            if seen > 0:
                stopping.request(signum)
                break
        if int(count) != self.cfg.train.micro_batches:
            raise ExecutionError(
                f"rank {self.rank}: step {step}: {int(count)} micro-batch losses were computed, expected "
                f"{self.cfg.train.micro_batches}"
            )
        dev.synchronize(self.device)
        result = StepResult(
            step=step,
            loss=total / count,
            lr=lr,
            grad_norm=outcome.grad_norm,
            skipped=outcome.skipped,
            scale=scale,
            tokens=self.tokens_per_step,
            step_time_s=self.pacer.end_step(time.perf_counter() - t0),
            speculated=self.schedule.options.async_optimizer and self.optimizer.speculating,
            rolled_back=int(undone),
            restepped=int(restepped),
            opt_exposed_s=exposed_seconds(times[0::2], times[1::2], one_clock=self.info.num_nodes == 1)
            / self.pacer.time_scale,
        )
        if self.schedule.options.async_optimizer and not result.speculated:
            self.validated_first.add(step)
        self.last_op_seconds = ctx.op_seconds
        if self.window.after(step):
            self._write_timeline()
        self.prediction.after_step(result)
        self.step_index += 1
        return result

    def _write_timeline(self) -> None:
        """The recorded window to rank 0, which writes it into ``run_dir`` beside the plan and prints
        the comparison (collective: every rank calls it after the window's last step)."""
        assert self.window.recorder is not None and self.optimizer is not None
        rec = self.window.recorder
        units = {stage.name: key for key, stage in self.optimizer.stages.items()}
        parts = gather_parts(self.pacer.modelled(rec.part(units)), rank=self.rank, world=self.world, group=self.group)
        rec.clear()
        if parts is not None:
            report = write_report(
                parts,
                self.schedule,
                self.cfg.run_dir,
                plan_costs=self.plan_costs(),
                param_bytes=float(self.dtype.itemsize),
                plan_schedule=self.plan_schedule(range(rec.first, rec.last + 1)),
            )
            print(report.line, flush=True)
            self._measurements = report.summary()
            self.window_costs = report.costs
        # the others wait here for rank 0's files, not inside the next step (which would time the drawing)
        self._all_reduce([0.0], "recorded window written")

    def plan_costs(self) -> CostTable | None:
        """The costs the plan beside a recorded timeline is simulated with; None: the window's own
        profiled costs (:func:`sysx.trace.costs.measured_costs`). A tuned run (rank 0) returns the
        table it was predicted with; a device that models its time (``device=emulated``) the table it
        models with."""
        if self.tuned_costs is not None:
            return self.tuned_costs.table(self.schedule)
        return self.pacer.plan.table if isinstance(self.pacer, EmulatedPacer) else None

    def recorded_iteration(self) -> float | None:
        """Rank 0: the recorded window's measured seconds per iteration, once written (else None)."""
        measured = self._measurements.get("measured")
        return measured["iteration_s"] if measured else None

    def measurements(self) -> dict[str, Any]:
        """``{"measured": ..., "plan": ...}`` of the recorded window on rank 0, once written (else
        empty); on an emulated device also its ``emulation`` report (collective then: every rank calls it)."""
        out: dict[str, Any] = dict(self._measurements)
        if self.prediction.section:
            out["prediction"] = self.prediction.section
        if self.placement_ranks:
            out["placement"] = self.placement_ranks
        if isinstance(self.pacer, EmulatedPacer):
            out["emulation"] = self.emulation_report()
        return out

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> float:
        """Mean loss over ``eval.batches`` micro-batches of the val split (forward-only program)."""
        n = self.cfg.eval.batches if batches is None else batches
        program = self._eval if n == self._eval.n_micro else self._evaluation(n)
        ops = program.ops[self.rank]
        ctx = StepContext(step=0, n_micro=n, split="val", training=False)
        self.pacer.begin_step(self.step_index, record=False)
        try:
            self.executor.run(ops, ctx)
            self.executor.wait_sends()  # no VALIDATE in a forward-only program
        except BaseException:
            self.executor.reset()
            raise
        local = float(torch.stack(ctx.losses).sum()) if ctx.losses else 0.0
        total, count = self._all_reduce([local, float(len(ctx.losses))], "evaluation (loss all-reduce)")
        return total / count

    @property
    def job_tag(self) -> str:
        """The job id every rank shares (it names the checkpoint saves too)."""
        return self.job_id

    def checkpoint_layers(self) -> dict[int, LayerSource]:
        """The layers of the sub-stages this rank owns (their masters, moments and step counts)."""
        assert self.optimizer is not None and self.params is not None
        out: dict[int, LayerSource] = {}
        for key, stage in self.optimizer.stages.items():
            out.update(stage_layer_sources(stage, self.params.layout(key), list(self.params.units[key].layers)))
        return out

    def restore_layers(self, ckpt: Checkpoint) -> None:
        """The owned sub-stages from ``ckpt`` (whatever schedule and rank count wrote it), then the
        owners push the new values to mirrors on other nodes (every rank calls this)."""
        assert self.optimizer is not None and self.params is not None
        for key, stage in self.optimizer.stages.items():
            indices = list(self.params.units[key].layers)
            restore_stage(
                stage,
                self.params.layout(key),
                indices,
                {i: ckpt.layer(i) for i in indices},
                what=f"checkpoint {ckpt.path}",
            )
        self.params.push_mirrors()
        self.params.barrier("checkpoint restore barrier")  # no rank reads a segment before its owner rewrote it

    def speculation_policy(self) -> SpeculationPolicy | None:
        """The rank optimizer's policy (every rank's is the same: they record one all-reduced outcome)."""
        return self.optimizer.policy if self.optimizer is not None else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 weights by parameter name (``layers.<i>.<name>``); collective: every rank
        calls it and gets the same dict (gathered over the CPU group, meant for tests and small models)."""
        assert self.params is not None
        assert self.optimizer is not None
        mine = self.params.master_state({key: stage.master for key, stage in self.optimizer.stages.items()})
        if self.world == 1:
            return mine
        parts: list[dict[str, torch.Tensor] | None] = [None] * self.world
        dist.all_gather_object(parts, mine, group=self.group)
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update(part or {})
        return dict(sorted(out.items(), key=lambda kv: (int(kv[0].split(".")[1]), kv[0])))

    def emulation_report(self) -> dict[str, Any]:
        """On an emulated device (collective: every rank calls it): the report of the steps so far,
        merged over the ranks (:func:`sysx.emulate.merge_report`), which rank 0 also prints."""
        assert isinstance(self.pacer, EmulatedPacer), "emulation_report() needs device=emulated"
        steps: list[Any] = [self.pacer.steps]
        if self.world > 1:
            steps = [None] * self.world
            dist.all_gather_object(steps, self.pacer.steps, group=self.group)
        plan, e = self.pacer.plan, self.cfg.emulate
        measured = sorted({s.step for stats in steps for s in stats})[e.warmup_steps :]  # as merge_report counts
        iteration, bubble = self.planned(measured)
        report = merge_report(
            steps,
            time_scale=e.time_scale,
            warmup_steps=e.warmup_steps,
            max_late=e.max_late,
            plan_iteration=iteration,
            plan_bubble=bubble,
        )
        if self.lane_plan is not None:  # the plan above has the device lane; the CPU lane's alone beside it
            report["plan"]["cpu_lane_iteration_s"] = plan.timeline.iteration
        report.update(
            cluster=plan.cluster.describe(),
            model=plan.model.name,
            seq_len=plan.model.seq_len,
            micro_batch_size=plan.model.micro_batch_size,
            schedule=self.schedule.name,
        )
        if self.rank == 0:
            print(describe(report), flush=True)
        return report

    def describe(self) -> str:
        """The plan of this run: schedule and options, partition, and which rank runs what."""
        sch, place = self.schedule, self.schedule.placement
        fwd = " | ".join(f"r{r}: " + ",".join(map(unit_label, place.fwd_stages(r))) for r in range(self.world))
        bwd = " | ".join(
            f"r{r}: " + ",".join(unit_label(s, k) for s, k in place.bwd_substages(r)) for r in range(self.world)
        )
        lines = [
            f"pipeline: {self.opts.describe()} | {self.world} rank(s) on {self.info.num_nodes} node(s) | "
            f"Nsf={sch.n_stages} d={sch.split} Nm={sch.n_micro} | ckpt {sch.options.ckpt} | "
            f"optimizer {sch.options.optimizer} | job {getattr(self, 'job_id', '?')}",
            *("  " + line for line in sch.partition.describe().splitlines()),
            f"  forward stages   {fwd}",
            f"  backward (owner) {bwd}",
        ]
        if isinstance(self.pacer, EmulatedPacer):
            plan = self.pacer.plan
            lines.append(
                f"  emulated: {plan.cluster.describe()}; costs of {plan.model.name} at "
                f"{plan.model.micro_batch_size}x{plan.model.seq_len} tokens per micro-batch; time x"
                f"{self.pacer.time_scale:g}; plan {self.planned()[0]:.3f} s/iteration, bubble "
                f"{100 * self.planned()[1]:.1f}%" + (" (with the device lane)" if self.lane_plan else "")
            )
        return "\n".join(lines)

    # ---------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Join optimizer threads, drop every view of shared memory and close the store (idempotent)."""
        if self._closed:
            return
        self._closed = True
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.reset()
            executor._modules.clear()
        if self.optimizer is not None:
            self.optimizer.close()
            self.optimizer = None
        if self.params is not None:
            self.params.close()
            self.params = None


def exposed_seconds(backward_ends: list[float], validate_ends: list[float], *, one_clock: bool) -> float:
    """The optimizer time of a step no compute hid: from the end of the last backward on any rank
    to the end of the last VALIDATE (optimizer jobs, all-reduce, rollbacks, re-steps). Ranks on one
    node share ``time.monotonic()``; across nodes the clocks differ, so the smallest per-rank span
    is taken (every rank's VALIDATE ends after the all-reduce that waits for the last backward)."""
    if one_clock:
        return max(0.0, max(validate_ends) - max(backward_ends))
    return max(0.0, min(v - b for b, v in zip(backward_ends, validate_ends)))


# ----------------------------------------------------------------------------------------- jobs
def train(cfg: SysxConfig, info: sdist.DistInfo) -> int:
    """The ``sysx-train`` job for a pipeline schedule (every rank runs it). Returns the exit status:
    0, or 1 after a runtime failure (a lost peer, a timeout, a plan mismatch), printed by every rank."""
    from sysx.optim.cores import apply_plan, plan_cores

    opts = options_from_config(cfg)
    info = sdist.init(timeout_s=opts.timeout_s, device=cfg.device)
    try:
        tuned_costs = None
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
        apply_plan(plan)
        trainer = PipelineTrainer(resolve(cfg), opts, info=info, tuned_costs=tuned_costs)
        return run_job(trainer, is_main=info.is_main, extra=trainer.describe())
    except (ExecutionError, sdist.PeerTimeout, TransferMismatch) as err:
        print(f"sysx-train: rank {info.rank}: error: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        sdist.shutdown()
