"""``schedule=single``: one process, one device, the AdaWS sliding window with per-block CPU Adam.

Library use mirrors the reference trainer: ``SingleTrainer(cfg).run(steps)`` returns one
:class:`sysx.metrics.StepResult` per step, computing what the reference computes, and
:meth:`SingleTrainer.state_dict` the fp32 weights under the same names. The optimizer follows the
pipeline's protocol (:class:`~sysx.optim.step_protocol.StepProtocol`, one
:class:`~sysx.optim.StageOptimizer` per group) and lanes (:mod:`sysx.single.lanes`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from sysx import device as dev
from sysx.checkpoint import Checkpoint
from sysx.checkpoint.saver import LayerSource
from sysx.config import ConfigError, SingleSection, SysxConfig
from sysx.data.loss_weights import weighted_mean
from sysx.device_memory import MemoryCap
from sysx.machine.hardware import GiB, HardwareProfile
from sysx.memory import plan_host_memory
from sysx.memory.views import drop_failure_views
from sysx.metrics import StepResult
from sysx.optim.cores import worker_threads_beside
from sysx.optim.device_lane import DeviceLane
from sysx.optim.placement import LaneRates, Placement
from sysx.optim.rollback_choice import choose_rollback, tier_disk_free
from sysx.optim.speculate import SpeculationPolicy, window_mode
from sysx.optim.stage import OptimSettings, StageReport
from sysx.optim.step_protocol import UNTIMED, StepProtocol
from sysx.optim.threads import OptimizerThreads
from sysx.optim.validation import StepOutcome
from sysx.single.executor import SlidingWindowExecutor
from sysx.single.hardware import machine_hardware
from sysx.single.host import HostState
from sysx.single.lanes import WORKERS, window_placement
from sysx.single.op_profile import device_profiler
from sysx.single.pass_timing import measure_passes, timed_plan
from sysx.single.plan_report import SinglePlan
from sysx.single.plan_request import ModelSizes, PlanError, plan_request_from_config
from sysx.single.planner import make_plan
from sysx.trace.report import TIMELINE_JSON, TIMELINE_PNG, write_window
from sysx.trace.timeline import merge
from sysx.trace.window import StepWindow
from sysx.trainers.base import Trainer, job_device
from sysx.trainers.checkpointing import restore_stage_from, stage_layer_sources
from sysx.trainers.job import run_job
from sysx.trainers.prediction import SinglePrediction

if TYPE_CHECKING:
    from sysx.data import TokenDataset
    from sysx.dist import DistInfo
    from sysx.model import LlamaModel


class SingleTrainer(Trainer):
    """The sliding-window trainer (see docs/architecture.mdstring); ``single`` overrides ``cfg.single``."""

    def __init__(
        self,
        cfg: SysxConfig,
        *,
        dataset: TokenDataset | None = None,
        model: LlamaModel | None = None,
        device: torch.device | str | None = None,
        single: SingleSection | None = None,
        hardware: HardwareProfile | None = None,
        optimizer_backend: str | None = None,
        lane_rates: LaneRates | None = None,
    ) -> None:
        if single is not None:
            single.validate()  # an explicit override; cfg.single was checked with the whole config
        super().__init__(cfg, dataset=dataset, device=device)
        cfg = self.cfg
        self.settings = single if single is not None else cfg.single
        self.device = job_device(cfg, device)
        if hardware is None:
            hardware = machine_hardware(self.settings.hardware, self.device, self.dtype)
        self.hardware = hardware
        # PyAO's throughputs and the DP's values use measured site times where they are meaningful (a GPU)
        request = dataclasses.replace(
            plan_request_from_config(cfg, self.settings, self.model_cfg), use_measured_times=dev.is_cuda(self.device)
        )
        profiler = device_profiler(
            self.model_cfg,
            cfg.train.seq_len,
            self.dtype,
            self.device,
            measure=dev.is_cuda(self.device),
            count_graph=request.keep_graph,
        )
        plan = make_plan(request, hardware, profiler=profiler)
        if not dev.is_cuda(self.device):  # the host computes: its passes are timed, not priced by FLOPs
            plan = timed_plan(plan, measure_passes(plan, self.device))
        self.plan: SinglePlan = plan
        if self.settings.print_plan:
            print(self.plan.render(), flush=True)
        self.memory_cap = MemoryCap(self.device, request.device_budget_bytes)  # restored by close()
        self.prediction = SinglePrediction(self.plan, self.device, optimizer_backend or cfg.optim.backend)
        try:
            self._build(cfg, optimizer_backend, model, lane_rates)
        except BaseException:
            self.memory_cap.close()
            raise
        dev.reset_peak_memory(self.device)

    def _build(
        self, cfg: SysxConfig, optimizer_backend: str | None, model: LlamaModel | None, lane_rates: LaneRates | None
    ) -> None:
        """The host state, the executor, the optimizer threads and the optimizer's placement."""
        o = cfg.optim
        try:
            mode = window_mode(self.settings.optimizer_overlap, o.speculate)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        settings = dataclasses.replace(
            OptimSettings.from_config(
                o, backend=optimizer_backend or o.backend, rollback=self._choose_rollback(o.rollback)
            ),
            speculate=mode,
        )
        self.host = HostState(
            self.model_cfg,
            dtype=self.dtype,
            optim=settings,
            model=model,
            init=self.layer_init(),
            job=self.job_tag,
            pin=dev.is_cuda(self.device),  # a device=cpu job on a GPU machine creates no CUDA context
        )
        self.executor = SlidingWindowExecutor(self.plan, self.host, self.device, self.plan.table.profile)
        self.threads = OptimizerThreads(
            self.host.stages,
            workers=WORKERS,
            threads_per_worker=worker_threads_beside(self.device),
            name="sysx-single-opt",
            device=self.device,
        )
        self.protocol = StepProtocol(
            self.threads, self.scaler, settings, fp16=cfg.precision == "fp16", total_norm=self.host.grad_norm
        )
        self.placement = self._place_optimizer(settings.backend, lane_rates)
        self.redone_steps = 0
        self.speculated_steps = 0
        self._waited = 0.0  # main-thread seconds blocked on optimizer work in the current step
        self.window = StepWindow(cfg.profile, self.device, 0, compute=self.executor.compute)
        self.executor.recorder = self.threads.recorder = self.window.recorder
        self._measurements: dict[str, dict[str, float]] = {}

    def _choose_rollback(self, requested: str) -> str:
        """``optim.rollback`` checked against this host's memory with the window's host state (every
        group on this process), ``auto`` resolved and said."""
        # the window's groups (every block, the embedding+head): with the tier its per-rank pools are
        # sized by the largest group, not by the whole model as one stage
        sizes, offload = ModelSizes.of(self.model_cfg), self.cfg.optim.offload
        groups = [(sizes.block_params, self.dtype)] * sizes.n_blocks + [(sizes.static_params, self.dtype)]
        mode, why = choose_rollback(
            requested,
            lambda r: plan_host_memory(groups, rollback=r, offload=offload, workers=WORKERS),
            disk_free=tier_disk_free(offload, self.cfg.optim.nvme_dir),
        )
        if why:
            print(why, flush=True)
        return mode

    def _place_optimizer(self, backend: str, rates: LaneRates | None) -> Placement:
        """``optim.placement``: which groups step on the device lane (:mod:`sysx.single.lanes`),
        printed once with the model's predicted saving."""
        o = self.cfg.optim
        placement, units = window_placement(
            o.placement,
            self.plan,
            [(g.name, g.layout.numel) for g in self.host.groups],
            separate_device=dev.is_cuda(self.device),
            speculative=self.protocol.policy.mode != "never",
            backend=backend,
            rates=rates,
        )
        if placement.device:
            self.use_device_lane(placement.device)
        # validating first, a fresh model's optimizer runs after the backward and holds the next
        # forward: on an H200 a 50M window's step took 0.42 s where its passes were priced at 0.10 s
        self.prediction.optimizer_s = placement.finish
        if o.placement != "cpu" and (placement.device or placement.cpu_finish > 0):
            print(f"optim.placement={o.placement}: {placement.describe(units, 'group')}", flush=True)
        return placement

    def use_device_lane(self, names: Sequence[str], lane: DeviceLane | None = None) -> None:
        """Step the groups ``names`` on ``lane`` (default: one on this job's device, in the activation
        ring, idle then) after every decision, beside the CPU lane's (re-)steps."""
        forward = [g.name for g in (self.host.static, *self.host.groups[:-1])]
        unknown = sorted(set(names) - set(forward))
        if unknown:
            raise ValueError(f"use_device_lane: no group named {', '.join(unknown)} (groups: {', '.join(forward)})")
        ordered = [n for n in forward if n in names]  # the next forward needs them in this order
        lane = lane if lane is not None else DeviceLane(self.device, self.executor.idle_between_steps())
        self.protocol.use_device_lane(dict.fromkeys(ordered, UNTIMED), lane)

    @property
    def on_device(self) -> tuple[str, ...]:
        """The groups the device lane steps, in forward order."""
        return tuple(self.protocol.on_device)

    @property
    def lane(self) -> DeviceLane | None:
        """The device lane (None: every group steps on the CPU)."""
        return self.protocol.lane

    # ------------------------------------------------------------------------------------ pieces
    @property
    def n_params(self) -> int:
        """Number of (distinct) parameters."""
        return self.host.n_params

    def host_batch(
        self, step: int, micro_batch: int, *, rows: int, split: str = "train", rows_per_step: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``micro_batch`` of ``rows`` sequences, in host memory (global rows as the reference's;
        ``rows_per_step``: the rows they are cut from, by default a training step's)."""
        from sysx.data import get_batch

        t = self.cfg.train
        return get_batch(
            self.dataset,
            seed=self.cfg.seed,
            step=step,
            micro_batch=micro_batch,
            micro_batch_size=rows,
            seq_len=t.seq_len,
            split=split,
            rows_per_step=rows_per_step or t.micro_batches * t.micro_batch_size,
        )

    def batch(
        self, step: int, micro_batch: int, *, rows: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`host_batch` on the device."""
        x, y = self.host_batch(step, micro_batch, rows=rows, split=split)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _before_load(self, group: int) -> None:
        """Block until ``group``'s optimizer work is done (the executor names Embedding+Head ``-1``)."""
        t0 = time.perf_counter()
        self.threads.wait_stage(self.host.groups[group].name)
        self._waited += time.perf_counter() - t0

    # ------------------------------------------------------------------------------------- steps
    def train_step(self) -> StepResult:
        """One optimizer step over the global batch."""
        step = self.step_index
        t0 = time.perf_counter()
        scale = float(self.scaler.scale)
        lr = self.lr_at(step)
        plan = self.plan
        t = self.cfg.train
        share = self.loss_weights(step, plan.micro_batches, t.micro_batches * t.micro_batch_size)
        host = [self.host_batch(step, j, rows=plan.chunk) for j in range(plan.micro_batches)]
        weights = [share.weight(y) for _, y in host]
        batches = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) for x, y in host]
        speculate = self.protocol.begin()
        groups = self.host.groups
        self.window.begin(step)
        self._waited = 0.0

        def on_grads(g: int, event: dev.Event) -> None:
            self.protocol.submit(groups[g].name, groups[g].grad, event, scale=scale, lr=lr)

        try:
            losses = self.executor.run_step(
                batches,
                scale=scale,
                on_grads=on_grads,
                before_load=self._before_load,
                divisors=[share.divisor(w) for w in weights],
            )
            t_backward = time.perf_counter()
            outcome = self._validate(self.threads.wait(), lr)
            self._waited += time.perf_counter() - t_backward
        finally:
            self.window.end()
        clean = self.protocol.record(outcome)  # the spare refresh runs into the next forward
        if speculate:
            self.speculated_steps += 1
            self.redone_steps += not clean
        loss_value = (
            weighted_mean([float(v) for v in losses], weights) if share.per_token else float(torch.stack(losses).mean())
        )
        dev.synchronize(self.device)
        result = StepResult(
            step=step,
            loss=loss_value,
            lr=lr,
            grad_norm=outcome.grad_norm,
            skipped=outcome.skipped,
            scale=scale,
            tokens=self.tokens_per_step,
            step_time_s=time.perf_counter() - t0,
            speculated=speculate,
            rolled_back=outcome.undone + outcome.restepped,
            restepped=outcome.restepped,
            opt_exposed_s=self._waited,
        )
        if self.window.after(step):
            self._write_timeline()
        self._check_prediction(result)
        self.step_index += 1
        return result

    def _check_prediction(self, result: StepResult) -> None:
        """The planner's prediction against this run, after its first steps (:mod:`sysx.trainers.prediction`)."""
        rec, measured = self.window.recorder, self._measurements.get("measured")
        recorded = (rec.first, rec.last, measured["iteration_s"]) if rec is not None and measured else None
        self.prediction.after_step(result, self.cfg.train.steps, recorded)

    def _write_timeline(self) -> None:
        """The recorded window into ``run_dir`` (timeline.json, timeline.png), compared with the
        planner's predicted step time; its last optimizer jobs are waited for, they belong to it."""
        assert self.window.recorder is not None
        self.threads.wait_stages()
        rec = self.window.recorder
        spans = merge([rec.part({g.name: (g.layer_indices[0], 0) for g in self.host.groups})])
        rec.clear()
        report = write_window(
            spans,
            self.cfg.run_dir,
            name="single",
            n_ranks=1,
            plan={"iteration_s": self.plan.times["step_s"]},
            plan_source="the planner's prediction",
        )
        print(f"{report.line} | {self.cfg.run_dir}/{{{TIMELINE_JSON},{TIMELINE_PNG}}}", flush=True)
        self._measurements = report.summary()

    def measurements(self) -> dict[str, dict[str, Any]]:
        """``{"measured": ..., "plan": ...}`` of the recorded window, once written (else empty), and
        the ``prediction`` check once made."""
        out: dict[str, dict[str, Any]] = dict(self._measurements)
        if self.prediction.section:
            out["prediction"] = self.prediction.section
        return out

    def _validate(self, reports: list[StageReport], lr: float) -> StepOutcome:
        """Decide this step from the groups' reports; the re-steps (speculation) or steps (validate
        first) are queued in forward order, Embedding+Head first, and run into the next forward; the
        device lane steps on this thread meanwhile."""
        forward = {g.name: i for i, g in enumerate([self.host.static, *self.host.groups[:-1]])}
        return self.protocol.decide(sorted(reports, key=lambda r: forward[r.stage]), lr)

    def evaluate(self, batches: int | None = None) -> float:
        """Mean loss over the reference's ``batches`` val micro-batches (the same sequences every time)."""
        self.threads.wait_stages()
        n = self.cfg.eval.batches if batches is None else batches
        mbs = self.cfg.train.micro_batch_size
        b = self.plan.chunk
        share = self.loss_weights(0, n, n * mbs, split="val")
        means, all_losses, all_weights = [], [], []
        for j in range(n):
            x, y = self.host_batch(0, j, rows=mbs, split="val", rows_per_step=n * mbs)
            all_weights += [share.weight(y[i : i + b]) for i in range(0, mbs, b)]
            x, y = x.to(self.device), y.to(self.device)
            pieces = [(x[i : i + b], y[i : i + b]) for i in range(0, mbs, b)]
            losses = self.executor.evaluate(pieces, self._before_load)
            all_losses += [float(v) for v in losses]
            rows = torch.tensor([p[0].shape[0] for p in pieces], dtype=torch.float32)
            means.append(float((torch.stack([v.cpu() for v in losses]) * rows).sum() / rows.sum()))
        return weighted_mean(all_losses, all_weights) if share.per_token else sum(means) / len(means)

    def finish_pending(self) -> None:
        """Wait for the optimizer steps still running on the CPU threads."""
        self.threads.wait_stages()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 weights by the reference trainer's parameter names (after pending steps finish)."""
        self.threads.wait_stages()
        return self.host.state_dict()

    def checkpoint_layers(self) -> dict[int, LayerSource]:
        """Every layer: each group's masters, moments and step count (call after :meth:`finish_pending`)."""
        out: dict[int, LayerSource] = {}
        for g in self.host.groups:
            out.update(stage_layer_sources(g.optimizer, g.layout, g.layer_indices))
        return out

    def speculation_policy(self) -> SpeculationPolicy:
        """The window's policy (saved and restored with the common state)."""
        return self.protocol.policy

    def load_checkpoint(self, ckpt: Checkpoint) -> None:
        """The common state; a checkpoint from before the policy was saved has ``last_step_passed``
        instead: a clean run of at least one step, or none."""
        super().load_checkpoint(ckpt)
        state = ckpt.trainer_state()
        if "speculation" not in state and not state.get("last_step_passed", True):
            self.protocol.policy.record(clean=False)

    def restore_layers(self, ckpt: Checkpoint) -> None:
        """Every group's masters, moments and step count from ``ckpt``; working copies rewritten."""
        self.threads.wait_stages()
        for g in self.host.groups:
            restore_stage_from(g.optimizer, g.layout, g.layer_indices, ckpt)

    def close(self) -> None:
        """Finish pending optimizer work, stop the threads and free the host state (after clearing the
        frames of a failure being handled, :func:`drop_failure_views`)."""
        drop_failure_views()
        try:
            self.threads.wait_stages()
        finally:
            try:
                self.threads.close()
                self.protocol.close()
                self.executor.close()
                self.host.close()
            finally:
                self.memory_cap.close()


def train(cfg: SysxConfig, info: DistInfo) -> int:
    """The ``sysx-train`` job for ``schedule=single``: plan, build, log, train, summarize. Returns 0."""
    from sysx.trainers.reference import check_single_process

    check_single_process(info, "single")
    try:
        trainer = SingleTrainer(cfg)
    except PlanError as err:
        raise ConfigError(f"schedule=single: {err}") from None
    p = trainer.plan
    seqs = f"{p.chunk} seqs" + (
        f" in {p.seq_chunks} sequence chunks of {p.seq_chunk} tokens" if p.seq_chunks > 1 else ""
    )
    extra = (
        f"single: W={p.window}/{p.sizes.n_blocks} blocks, {p.rounds} rounds x {p.chunks} chunks x {seqs}, "
        f"device working set {p.device_bytes['total'] / GiB:.2f} GiB of {p.device_budget / GiB:.2f} GiB"
    )
    return run_job(trainer, extra=extra)
