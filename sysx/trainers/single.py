"""``schedule=single``: one process, one device, the AdaWS sliding window with per-block CPU Adam.

Library use mirrors the reference trainer: ``SingleTrainer(cfg).run(steps)`` returns one
:class:`sysx.metrics.StepResult` per step and :meth:`SingleTrainer.state_dict` the fp32 weights
under the same names. A step computes exactly what the reference computes — the same global batch
(``train.micro_batch_size * train.micro_batches`` sequences, cut into the plan's chunks), mean of
the per-micro-batch losses, fp32 unscaled gradients, global L2 norm, loss-scaler decision, clipping
with ``clip_grad_norm_`` semantics, AdamW at ``lr_at(step)`` with weight decay on every parameter.

Optimizer pipeline (beyond the paper, as SysX does it): in the last round, each block's gradients
are handed to a CPU thread the moment their copy home completes; the thread converts and unscales
them, takes their norm and — when the step is *speculative* — applies that block's Adam step while
the GPU is still working on earlier blocks. Clipping and fp16 overflow need the global norm, which
is known only after the whole backward: a speculative step that turns out to need clipping (or an
fp16 overflow) is undone (``CpuAdam.undo``) and redone/skipped. ``single.optimizer_overlap=auto``
speculates when no check can veto the step or when the previous step passed the checks, and
otherwise steps after the norm in forward order, overlapped with the next step's forward (the next
forward waits per block for that block's step).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sysx import device as dev
from sysx.config import ConfigError, SingleSection, SysxConfig
from sysx.metrics import StepResult
from sysx.single.executor import SlidingWindowExecutor
from sysx.single.hardware import GiB, HardwareProfile, assumed_hardware, measure_hardware
from sysx.single.host import AdamHyper, HostState, OptimizerWorker
from sysx.single.planner import PlanError, Profiler, SinglePlan, make_plan, plan_request_from_config
from sysx.single.sites import device_profiler
from sysx.trainers.base import Trainer, job_device, run_job

if TYPE_CHECKING:
    from sysx.data import TokenDataset
    from sysx.dist import DistInfo
    from sysx.model import LlamaModel


class SingleTrainer(Trainer):
    """The sliding-window trainer (see module docstring); ``single`` overrides ``cfg.single``."""

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
    ) -> None:
        if single is not None:
            single.validate()  # an explicit override; cfg.single was checked with the whole config
        super().__init__(cfg, dataset=dataset)
        cfg = self.cfg
        self.settings = single if single is not None else cfg.single
        self.device = job_device(cfg, device)
        if hardware is None:
            if self.settings.hardware == "measure":
                hardware = measure_hardware(self.device, self.dtype)
            else:
                hardware = assumed_hardware(self.settings.hardware)
        self.hardware = hardware
        # PyAO's throughputs and the DP's values use measured site times where they are meaningful (a GPU)
        request = dataclasses.replace(plan_request_from_config(cfg, self.settings, self.model_cfg),
                                      use_measured_times=dev.is_cuda(self.device))
        profiler = device_profiler(self.model_cfg, cfg.train.seq_len, self.dtype, self.device,
                                   measure=dev.is_cuda(self.device))
        self.plan: SinglePlan = make_plan(request, hardware, profiler=profiler)
        if self.settings.print_plan:
            print(self.plan.render(), flush=True)
        if dev.is_cuda(self.device) and request.device_budget_bytes:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, request.device_budget_bytes / total), self.device)

        o = cfg.optim
        backend = optimizer_backend or getattr(o, "backend", "auto")
        hyper = AdamHyper(lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=o.eps, weight_decay=o.weight_decay, backend=backend)
        self.host = HostState(self.model_cfg, dtype=self.dtype, hyper=hyper, seed=cfg.seed, model=model)
        self.executor = SlidingWindowExecutor(self.plan, self.host, self.device, self.plan.table.profile)
        self.worker = OptimizerWorker("adam")  # per-group Adam steps, in submission order
        self.norm_worker = OptimizerWorker("norm")  # gradient conversion and norms, ahead of the steps
        self._last_passed = True  # did the previous step need neither clipping nor a skip?
        self.redone_steps = 0
        self.speculated_steps = 0
        dev.reset_peak_memory(self.device)

    # ------------------------------------------------------------------------------------ pieces
    @property
    def n_params(self) -> int:
        """Number of (distinct) parameters."""
        return self.host.n_params

    def batch(self, step: int, micro_batch: int, *, rows: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``micro_batch`` of ``rows`` sequences, on the device (global rows as the reference's)."""
        from sysx.data import get_batch

        x, y = get_batch(self.dataset, seed=self.cfg.seed, step=step, micro_batch=micro_batch,
                         micro_batch_size=rows, seq_len=self.cfg.train.seq_len, split=split)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _before_load(self, group: int) -> None:
        """Block until ``group``'s optimizer work is done (the executor names Embedding+Head ``-1``)."""
        self.worker.wait(group % len(self.host.groups))

    def _speculate(self) -> bool:
        can_veto = self.cfg.optim.grad_clip > 0 or self.cfg.precision == "fp16"
        mode = self.plan.request.optimizer_overlap
        if mode == "forward":
            return False
        if mode == "backward" or not can_veto:
            return True
        return self._last_passed

    # ------------------------------------------------------------------------------------- steps
    def train_step(self) -> StepResult:
        """One optimizer step over the global batch."""
        step = self.step_index
        t0 = time.perf_counter()
        scale = float(self.scaler.scale)
        lr = self.lr_at(step)
        plan = self.plan
        batches = [self.batch(step, j, rows=plan.chunk) for j in range(plan.micro_batches)]
        speculate = self._speculate()
        groups = self.host.groups
        norms: dict[int, list[torch.Tensor]] = {}  # per-parameter norms, like get_total_norm

        def on_grads(g: int, event: dev.Event) -> None:
            g = g % len(groups)

            def norm_task() -> torch.Tensor:
                event.synchronize()
                grad = groups[g].grad_fp32(scale)
                norms[g] = [torch.linalg.vector_norm(v) for v in groups[g].layout.views(grad)]
                return grad

            converted = self.norm_worker.submit(g, norm_task)
            if speculate:
                def step_task() -> None:
                    groups[g].opt.step(converted.result(), lr=lr)
                    groups[g].publish()

                self.worker.submit(g, step_task)

        losses = self.executor.run_step(batches, scale=scale, on_grads=on_grads, before_load=self._before_load)
        self.norm_worker.wait_all()  # the norms only: speculative steps keep running into the next forward
        order = [len(groups) - 1] + list(range(len(groups) - 1))  # embedding+head first, then blocks
        total = torch.linalg.vector_norm(torch.stack(self._reference_order(norms)))
        found_inf = not bool(torch.isfinite(total))
        skipped = bool(self.scaler.update(found_inf))
        clip = self.cfg.optim.grad_clip
        coef = torch.clamp(clip / (total + 1e-6), max=1.0) if clip > 0 and not skipped else None
        needs_clip = coef is not None and float(coef) < 1.0
        self._last_passed = not skipped and not needs_clip
        if speculate:
            self.speculated_steps += 1
        if speculate and (skipped or needs_clip):
            self.redone_steps += 1
            for g in order:
                self.worker.submit(g, self._redo_task(g, scale, lr, None if skipped else coef))
        elif not speculate and not skipped:
            for g in order:
                self.worker.submit(g, self._step_task(g, scale, lr, coef))
        loss_value = float(torch.stack(losses).mean())
        dev.synchronize(self.device)
        result = StepResult(step=step, loss=loss_value, lr=lr, grad_norm=float(total), skipped=skipped, scale=scale,
                            tokens=self.tokens_per_step, step_time_s=time.perf_counter() - t0)
        self.step_index += 1
        return result

    def _reference_order(self, norms: dict[int, list[torch.Tensor]]) -> list[torch.Tensor]:
        """Per-parameter norms in ``model.parameters()`` order (Embedding, Blocks, Head), as the reference stacks them."""
        groups = self.host.groups
        static = groups[-1]
        first = [n for n, e in zip(norms[len(groups) - 1], static.layout.entries) if e.name.startswith("0.")]
        last = [n for n, e in zip(norms[len(groups) - 1], static.layout.entries) if not e.name.startswith("0.")]
        return first + [n for g in range(len(groups) - 1) for n in norms[g]] + last

    def _step_task(self, g: int, scale: float, lr: float, coef: torch.Tensor | None) -> Callable[[], None]:
        group = self.host.groups[g]

        def task() -> None:
            grad = group.grad_fp32(scale)
            if coef is not None:
                grad.mul_(coef)
            group.opt.step(grad, lr=lr)
            group.publish()

        return task

    def _redo_task(self, g: int, scale: float, lr: float, coef: torch.Tensor | None) -> Callable[[], None]:
        """Undo the speculative step of group ``g``; then, unless the step is skipped, step with clipped grads."""
        group = self.host.groups[g]

        def task() -> None:
            grad = group.grad_fp32(scale)
            group.opt.undo(grad)
            if coef is not None:
                grad.mul_(coef)
                group.opt.step(grad, lr=lr)
            group.publish()

        return task

    def evaluate(self, batches: int | None = None) -> float:
        """Mean loss over the reference's ``batches`` val micro-batches (the same sequences every time)."""
        self.worker.wait_all()
        n = self.cfg.eval.batches if batches is None else batches
        mbs = self.cfg.train.micro_batch_size
        b = self.plan.chunk
        means = []
        for j in range(n):
            x, y = self.batch(0, j, rows=mbs, split="val")
            pieces = [(x[i:i + b], y[i:i + b]) for i in range(0, mbs, b)]
            losses = self.executor.evaluate(pieces, self._before_load)
            rows = torch.tensor([p[0].shape[0] for p in pieces], dtype=torch.float32)
            means.append(float((torch.stack([v.cpu() for v in losses]) * rows).sum() / rows.sum()))
        return sum(means) / len(means)

    def finish_pending(self) -> None:
        """Wait for the optimizer steps still running on the CPU threads."""
        self.worker.wait_all()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 weights by the reference trainer's parameter names (after pending steps finish)."""
        self.worker.wait_all()
        return self.host.state_dict()

    def close(self) -> None:
        """Finish pending optimizer work and stop the threads."""
        self.norm_worker.close()
        self.worker.close()


def train(cfg: SysxConfig, info: DistInfo) -> int:
    """The ``sysx-train`` job for ``schedule=single``: plan, build, log, train, summarize. Returns 0."""
    from sysx.trainers.reference import check_single_process

    check_single_process(info, "single")
    try:
        trainer = SingleTrainer(cfg)
    except PlanError as err:
        raise ConfigError(f"schedule=single: {err}") from None
    p = trainer.plan
    extra = (f"single: W={p.window}/{p.sizes.n_blocks} blocks, {p.rounds} rounds x {p.chunks} chunks x {p.chunk} seqs, "
             f"device working set {p.device_bytes['total'] / GiB:.2f} GiB of {p.device_budget / GiB:.2f} GiB")
    return run_job(trainer, extra=extra)
