"""The CPU-optimizer side of one rank: OFFLOAD_GRADS targets, OPTIM_STEP and VALIDATE.

One :class:`sysx.optim.StageOptimizer` per backward sub-stage this rank owns, run by
:class:`sysx.optim.OptimizerThreads`. Asynchronous schedules (SysX) hand each sub-stage to the
rank's :class:`sysx.optim.step_protocol.StepProtocol` at OPTIM_STEP and decide at VALIDATE;
synchronous ones (the baselines) load and check at VALIDATE and step at each OPTIM_STEP.

With replicas (:mod:`sysx.replicas`) each stage optimizer holds this replica's shard of its
sub-stage, and a :class:`~sysx.runtime.replica_sync.GradReducer` sums the replicas' gradients of
that shard between the offload and the optimizer job, which waits for the sum instead of the copy.

With ``optim.offload=nvme`` the stages' fp32 master, m and v live in an
:class:`~sysx.optim.nvme.tier.NvmeTier` (one state directory per rank): in 16-bit runs the fp32
masters leave host memory once written there, and (without replicas) the fp32 gradients are
converted per optimizer job into a small per-rank :class:`~sysx.optim.scratch.ScratchPool` instead of
a buffer per sub-stage; in fp32 runs the master is the shared working copy and stays.

A spread step (``schedule.spread_last_step``, :mod:`sysx.schedule.spread`) gives every rank of the
owner's node a stage optimizer of the unit's shard (:meth:`StageParams.shard`); their jobs load
their slices of the owner's landing segment after a :class:`~sysx.runtime.spread_sync.HandOff`.
"""

from __future__ import annotations

import dataclasses
import gc

import torch
import torch.distributed as dist

from sysx import device as dev
from sysx.dist import wait_for
from sysx.emulate.pacer import Pacer
from sysx.memory.budget import grad_scratch_buffers, uses_grad_scratch
from sysx.memory.pinned import HostBuffers
from sysx.optim.cores import plan_cores
from sysx.optim.device_lane import DeviceLane
from sysx.optim.grad_norm import layer_pieces
from sysx.optim.loss_scaler import LossScaler, NonFiniteGradients
from sysx.optim.nvme.tier import NvmeTier, TierStage
from sysx.optim.nvme.tier import Pace as DiskPace
from sysx.optim.scratch import ScratchPool
from sysx.optim.speculate import SpeculationPolicy
from sysx.optim.stage import OptimSettings, StageOptimizer
from sysx.optim.step_protocol import LanePacer, LaneSeconds, StepProtocol
from sysx.optim.threads import OptimizerThreads, Pace
from sysx.optim.validation import StepOutcome, apply_checked, load_and_check
from sysx.runtime.replica_sync import GradReducer
from sysx.runtime.spread_sync import HandOff
from sysx.runtime.stage_params import StageParams, SubStage


class RankOptimizer:
    """Optimizer state and per-step protocol of the sub-stages one rank owns."""

    def __init__(
        self,
        params: StageParams,
        settings: OptimSettings,
        scaler: LossScaler,
        *,
        group: dist.ProcessGroup | None,
        local_rank: int = 0,
        local_world_size: int = 1,
        pace: Pace | None = None,
        replica_group: dist.ProcessGroup | None = None,
        pacer: Pacer | None = None,
        disk_pace: DiskPace | None = None,
        spread_groups: dict[tuple[int, int], dist.ProcessGroup] | None = None,
    ) -> None:
        """``replica_group``: this pipeline rank's replicas (gradient reductions; None: one
        replica); ``pacer``: the emulated device's (charges the reductions and hand-offs);
        ``disk_pace``: called after each NVMe tier transfer (the emulated disk's time);
        ``spread_groups``: the sharers of each spread unit this rank steps a shard of."""
        self.settings = settings
        self.scaler = scaler
        self.group = group
        self.rank, self.timeout_s = params.rank, params.timeout_s
        self.dtype = params.dtype
        self.stages: dict[tuple[int, int], StageOptimizer] = {}
        self.host_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.buffers = HostBuffers(f"rank {params.rank} host gradients", pin=params.pin)  # the D2H copies land here
        self.events: dict[tuple[int, int], dev.Event] = {}
        self.outcome: StepOutcome | None = None
        self.step_seconds = 0.0
        self.reduced: dict[tuple[int, int], torch.Tensor] = {}  # replicas: each unit's summed fp32 shard
        self.reducer: GradReducer | None = None
        self._peers_landing: dict[tuple[int, int], list[torch.Tensor]] | None = None
        self.spread_grads: dict[tuple[int, int], torch.Tensor] = {}  # a spread unit: this rank's slice of the landing
        self._spread_groups = spread_groups or {}
        self.pacer = pacer or Pacer()
        self.norm_slots = params.norm_slots()  # a slot per layer (and a spread step's cut layers' tails)
        self.tier: NvmeTier | None = None
        self.scratch: ScratchPool | None = None  # 16-bit with the tier: the fp32 gradients, per job
        try:
            workers, threads = settings.workers, settings.threads_per_worker
            if workers is None or threads is None:
                plan = plan_cores(
                    n_stages=len(params.owned()),
                    backend=settings.backend,
                    local_rank=local_rank,
                    local_world_size=local_world_size,
                    workers=workers,
                )
                workers, threads = plan.optimizer_workers, threads or plan.threads_per_worker
            if settings.offload == "nvme":
                self.tier = self._open_tier(params, workers, disk_pace, pacer)
            self._build_stages(params, workers)
            if params.replica_layout.replicas > 1:
                assert replica_group is not None, "replicas need their process group"
                self._build_reducer(params, replica_group, pacer)
            self.threads = OptimizerThreads(
                list(self.stages.values()),
                workers=workers,
                threads_per_worker=threads,
                name=f"sysx-opt-r{params.rank}",
                pace=pace,
            )
        except BaseException:
            self._release()
            raise
        self.protocol = StepProtocol(
            self.threads,
            scaler,
            settings,
            fp16=self.dtype == torch.float16,
            group=group,
            norm_pieces=self.norm_slots,  # the norm per layer: the same bits in every layout
        )

    def _open_tier(
        self, params: StageParams, workers: int, pace: DiskPace | None, pacer: Pacer | None = None
    ) -> NvmeTier:
        """The owned sub-stages' (or replica shards') states in this rank's directory under
        ``optim.nvme_dir``, registered in backward order (the first step's read-ahead order). An
        emulated device (``pacer``) paces the transfers on its disk lane, each charged as its share
        of the emulated model's state (one slot of every stage here is what an iteration reads)."""
        from sysx.optim.nvme.open_tier import open_tier

        layout, fp32 = params.replica_layout, self.dtype == torch.float32
        stages = [
            TierStage.of(u.key, len(layout.shard(u.numel)), param_in_ram=fp32, rollback=self.settings.rollback)
            for u in params.owned()
        ]
        if pacer is not None:
            pace = pace or pacer.disk_pace()
            pacer.calibrate_disk(sum(s.nbytes for s in stages))
        return open_tier(
            self.settings,
            stages,
            job=params.store.job,
            node=params.info.node_rank,
            rank=params.rank,
            workers=workers,
            pace=pace,
            pin=params.pin,
        )

    def _stage_optimizer(
        self, params: StageParams, unit: SubStage, target: torch.Tensor | None, grad32: torch.Tensor | None
    ) -> StageOptimizer:
        """The optimizer of ``unit`` (with the NVMe tier: its state written to its file, and in
        16-bit runs the RAM master given up); ``grad32`` None: its fp32 gradients are converted per
        job into :attr:`scratch`. An empty shard (a small spread unit) steps nothing, on torch."""
        key = (unit.stage, unit.sub)
        empty = params.masters[key].numel() == 0
        stage = StageOptimizer.from_settings(
            unit.key,
            params.masters[key],
            dataclasses.replace(self.settings, backend="torch") if empty else self.settings,
            target=target,
            grad_buffer=grad32,
            keep_grads=grad32 is not None,
            no_decay=params.no_decay(unit),
            scratch=self.scratch,
            store=self.tier.state(unit.key) if self.tier is not None else None,
            pieces=layer_pieces(params.numels, unit.layers, params.shard(unit), self.norm_slots),
        )
        if self.tier is not None and self.dtype != torch.float32:
            del params.masters[key]  # on disk now: the RAM this frees is what the tier is for
        return stage

    def _build_stages(self, params: StageParams, workers: int) -> None:
        """One optimizer and one host gradient buffer per owned sub-stage. 16-bit runs with the NVMe
        tier keep no fp32 gradient buffer per sub-stage where a pool is smaller: each job converts
        the 16-bit landing buffer into a buffer lent by :attr:`scratch` and gives it back; undo and
        re-step convert again, bit for bit (:func:`sysx.memory.budget.uses_grad_scratch`)."""
        if params.replica_layout.replicas > 1:
            self._build_shards(params)  # the reducer sums into each shard's own fp32 buffer
            return
        fp32 = self.dtype == torch.float32
        numels = [u.numel for u in params.owned()]
        if self.tier is not None and not fp32 and uses_grad_scratch(numels, workers=workers):
            self.scratch = ScratchPool(max(numels), grad_scratch_buffers(workers))
        for unit in params.stepped():
            key = (unit.stage, unit.sub)
            if key in params.spread:
                self._build_spread_stage(params, unit)
                continue
            if fp32:  # the offload lands in the optimizer's own fp32 buffer
                grad32 = self.buffers.empty(unit.numel, torch.float32)
                self.stages[key] = self._stage_optimizer(params, unit, None, grad32)
                self.host_grads[key] = grad32
                continue
            kept = torch.empty(unit.numel, dtype=torch.float32) if self.scratch is None else None
            self.stages[key] = self._stage_optimizer(params, unit, params.shared[key], kept)
            self.host_grads[key] = self.buffers.empty(unit.numel, self.dtype)

    def _build_spread_stage(self, params: StageParams, unit: SubStage) -> None:
        """The optimizer of this rank's shard of a spread unit: it loads its slice of the owner's
        landing segment (fp32 runs: steps with it in place, as a replica's shard does), writes its
        slice of the working copy; the owner offloads into the whole segment."""
        key, cut = (unit.stage, unit.sub), params.shard(unit)
        if key not in self._spread_groups:
            raise RuntimeError(f"rank {self.rank} shares the step of {unit.key} but was given no group of its sharers")
        landing = params.spread_landing[key]
        mine = landing[cut.start : cut.stop]
        if self.dtype == torch.float32:
            self.stages[key] = self._stage_optimizer(params, unit, None, mine)
        else:
            kept = torch.empty(len(cut), dtype=torch.float32)
            self.stages[key] = self._stage_optimizer(params, unit, params.shared[key][cut.start : cut.stop], kept)
        self.spread_grads[key] = mine
        if unit.owner == self.rank:
            self.host_grads[key] = landing

    def _build_shards(self, params: StageParams) -> None:
        """One optimizer per owned sub-stage over this replica's shard, and the full-size buffer
        each unit's offload lands in (a segment the node's other replicas read on the ``node``
        path). The reducer sums into the stage's fp32 gradient buffer: in fp32 runs that is the
        shard's own slice of the landing buffer (summed in place), else an fp32 shard of its own."""
        layout = params.replica_layout
        landing: dict[tuple[int, int], torch.Tensor] = {}
        peers = None
        if layout.reduction == "node":
            landing, peers = params.grad_landings()
        else:
            for unit in params.owned():
                landing[(unit.stage, unit.sub)] = self.buffers.empty(unit.numel, self.dtype)
        for unit in params.owned():
            key, cut = (unit.stage, unit.sub), layout.shard(unit.numel)
            fp32 = self.dtype == torch.float32
            target = None if fp32 else params.shared[key][cut.start : cut.stop]
            grad32 = landing[key][cut.start : cut.stop] if fp32 else torch.empty(len(cut), dtype=torch.float32)
            self.stages[key] = self._stage_optimizer(params, unit, target, grad32)
            self.reduced[key], self.host_grads[key] = grad32, landing[key]
        self._peers_landing = peers

    def _build_reducer(self, params: StageParams, group: dist.ProcessGroup, pacer: Pacer | None) -> None:
        """The thread that sums the replicas' gradients of every owned unit."""
        self.reducer = GradReducer(
            params.replica_layout,
            self.host_grads,
            self.reduced,
            group=group,
            timeout_s=params.timeout_s,
            pacer=pacer,
            peers_landing=self._peers_landing,
        )

    def host_bytes(self) -> dict[str, int]:
        """Host bytes this rank's optimizer holds: ``optimizer`` (fp32 masters apart from the shared
        copy, Adam m and v, the fp32 gradients it steps with; with the NVMe tier the tier's staging
        buffers and the fp32 gradients: in 16-bit runs without replicas the scratch pool) and ``landing`` (the rest of the buffers the offloads land
        in: 16-bit, or with replicas the other shards' part)."""
        optimizer = landing = 0
        if self.tier is not None:
            optimizer += self.tier.host_bytes
        if self.scratch is not None:
            optimizer += 4 * self.scratch.numel * self.scratch.count
        for key, stage in self.stages.items():
            if self.tier is None:
                optimizer += (8 if self.dtype == torch.float32 else 12) * stage.numel  # (master), m, v
            if self.scratch is None:
                optimizer += 4 * stage.numel
            full = self.host_grads.get(key)  # None: a spread unit's sharer, landing in the owner's segment
            if full is not None and (self.dtype != torch.float32 or full.numel() != stage.numel):
                landing += full.nbytes - (4 * stage.numel if self.dtype == torch.float32 else 0)
        return {"optimizer": optimizer, "landing": landing}

    def _grads(self, unit: tuple[int, int]) -> tuple[torch.Tensor, dev.Event | None]:
        """What the optimizer job of ``unit`` loads and waits for: the offloaded gradients and their
        copy's event, with replicas the summed shard and its reduction, and for a spread unit this
        rank's slice of the owner's landing segment and the sharers' hand-off."""
        if unit in self.spread_grads:
            handoff = HandOff(
                unit,
                offload=self.events.get(unit),
                group=self._spread_groups[unit],
                rank=self.rank,
                timeout_s=self.timeout_s,
                pacer=self.pacer,
            )
            return self.spread_grads[unit], handoff
        if self.reducer is None:
            return self.host_grads[unit], self.events.get(unit)
        return self.reduced[unit], self.reducer.done.get(unit)

    @property
    def policy(self) -> SpeculationPolicy:
        """The speculation policy (saved and restored with the checkpoint)."""
        return self.protocol.policy

    @property
    def speculating(self) -> bool:
        """Whether the current step steps before its validation."""
        return self.protocol.speculating

    def use_device_lane(self, units: dict[tuple[int, int], LaneSeconds], lane: DeviceLane, pacer: LanePacer) -> None:
        """Step ``units`` on ``lane`` after every validation (``pacer`` charges their modelled times)."""
        self.protocol.use_device_lane({self._stage(u).name: s for u, s in units.items()}, lane, pacer)

    # -------------------------------------------------------------------------------- per step
    def begin(self) -> None:
        """Forget the previous step's offloads and decision."""
        self.events.clear()
        self.outcome = None
        self.step_seconds = 0.0
        if self.reducer is not None:
            self.reducer.begin()
        self.protocol.begin()

    def offloaded(self, unit: tuple[int, int], event: dev.Event) -> None:
        """Record that ``unit``'s gradients are on their way to :attr:`host_grads` (replicas: queue
        their reduction behind the copy)."""
        self.events[unit] = event
        if self.reducer is not None:
            self.reducer.submit(unit, event)

    def submit(self, unit: tuple[int, int], *, lr: float, scale: float) -> None:
        """Asynchronous OPTIM_STEP: a worker waits for the offload, checks and steps (only checks
        when this step does not speculate)."""
        name = self._stage(unit).name
        grads, ready = self._grads(unit)
        self.protocol.submit(name, grads, ready, scale=scale, lr=lr)

    def validate_async(self, *, lr: float) -> StepOutcome:
        """Wait for the workers, then SysX's post-step validation (rollback / clipping re-step), or,
        when the step did not speculate, the decision and then every sub-stage's step; the device
        lane steps beside the CPU lane's (re-)steps, and all of them are done on return."""
        try:
            self.outcome = outcome = self.protocol.decide(self.threads.wait(), lr)
        except NonFiniteGradients:
            self._rolled_back_everywhere()
            raise
        self.threads.wait_stages()
        self.protocol.record(outcome)
        return outcome

    def _rolled_back_everywhere(self) -> None:
        """Every rank raises NonFiniteGradients (fp32/bf16) after its rollback and no end-of-step
        all-reduce follows: wait until every rank's rollback is done, so that a caller going on
        after the error never reads a working copy (or a replica's shard) still being restored."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return
        work = dist.barrier(group=self.group, async_op=True)
        what = "barrier after the rollback of a step with non-finite gradients"
        wait_for(work, rank=self.rank, what=what, peer=None, timeout_s=self.timeout_s, collective=True)

    def validate_sync(self, *, scale: float) -> StepOutcome:
        """Validate first (baselines): load and check every offloaded sub-stage, reduce, decide."""
        names = {self.stages[u].name: u for u in self.events}
        loads = {n: self._grads(u) for n, u in names.items()}
        self.outcome = load_and_check(
            {n: grads for n, (grads, _) in loads.items()},
            self.threads,
            self.scaler,
            max_grad_norm=self.settings.grad_clip,
            group=self.group,
            events={n: ready for n, (_, ready) in loads.items() if ready is not None},
            scale=scale,
            norm_pieces=self.protocol.norm_pieces,
        )
        return self.outcome

    def step_sync(self, unit: tuple[int, int], *, lr: float) -> None:
        """Synchronous OPTIM_STEP after :meth:`validate_sync`: clip and step ``unit`` (unless skipped)."""
        if self.outcome is None:
            raise RuntimeError(f"OPTIM_STEP s{unit[0]}.{unit[1]}: a synchronous step needs VALIDATE first")
        apply_checked(self._stage(unit), self.outcome, lr)

    def _stage(self, unit: tuple[int, int]) -> StageOptimizer:
        try:
            return self.stages[unit]
        except KeyError:
            raise RuntimeError(
                f"sub-stage s{unit[0]}.{unit[1]} is not owned by this rank (owned: "
                f"{sorted(self.stages)}); its optimizer lives on the rank running its backward"
            ) from None

    # ------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Join the worker threads and release the optimizers (their views of shared memory too)."""
        if self.reducer is not None:
            self.reducer.close()
        self.threads.close()
        self.protocol.close()
        self._release()

    def _release(self) -> None:
        """Release the optimizers, the NVMe tier (its files removed) and the host gradient buffers."""
        for stage in self.stages.values():
            stage.close()
        self.stages.clear()
        if self.scratch is not None:
            self.scratch.close()
        self.host_grads.clear()
        self.spread_grads.clear()
        self.reduced.clear()
        self.outcome = None  # a synchronous step's outcome holds the loaded gradients
        self._peers_landing = None
        if self.reducer is not None:  # a failed start: the reducer thread was started
            self.reducer.close()
            self.reducer = None
        tier, self.tier = self.tier, None
        if tier is not None:  # last: whatever held a view of a staging buffer is released by now
            gc.collect()  # a finished job's frame or traceback in a reference cycle may still hold one
            tier.close()
        self.events = {}
        self.buffers.close()
