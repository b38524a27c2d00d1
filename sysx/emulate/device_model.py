"""What a pipeline run's time is planned with and compared against, by device kind, decided once.

:func:`device_model` reads ``cfg.device`` and returns a :class:`DeviceModel` (a real device: its
own streams and clock, no modelled plan) or an :class:`EmulatedDeviceModel` (``device=emulated``:
the schedule is cut like the emulated preset, the :class:`~sysx.emulate.costs.EmulatedPlan` paces
the run and is what the measurement is compared with). The trainer asks the object, never the kind:
its pacer, the cost table its plans simulate, the planned iteration, the ``emulation`` report, its
line of the run header and the optimizer workers it models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch.distributed as dist

from sysx.config import SysxConfig
from sysx.config.choices import EMULATED_DEVICE
from sysx.emulate.costs import EmulatedPlan, LaneTimes, device_lane_plan, emulated_model, plan_emulation
from sysx.emulate.pacer import EmulatedPacer, Pacer
from sysx.emulate.report import describe, merge_report, span_seconds
from sysx.model import ModelConfig
from sysx.replicas import ReplicaLayout
from sysx.schedule import CostTable, Schedule, validate_first


class ScheduleBuilder(Protocol):
    """Builds the run's schedule for a model cut (its layers) at a sequence length."""

    def __call__(self, model_cfg: ModelConfig, *, seq_len: int) -> Schedule: ...


class DeviceModel:
    """A real device: nothing is modelled, the run's plans use the costs it is given."""

    plan: EmulatedPlan | None = None  # the modelled plan the run paces itself by (emulated only)
    lane_plan: tuple[float, float] | None = None  # that plan with the device lane (emulated only)
    models_memory = False  # True: the device's memory is modelled, not measured

    def __init__(self, schedule: Schedule, pacer: Pacer | None = None) -> None:
        self.schedule = schedule
        self.pacer = pacer if pacer is not None else Pacer()
        self.validated_first: set[int] = set()  # steps whose optimizer stepped after VALIDATE (no speculation)
        self._validate_first: Schedule | None = None

    @property
    def table(self) -> CostTable | None:
        """The cost table the device models time with (None: none, the run is measured)."""
        return None

    def table_for(self, schedule: Schedule) -> CostTable | None:
        """The cost table the device models ``schedule`` with: this run's schedule or its validating-first
        program (:meth:`plan_schedule`); None: none, the run is measured."""
        return None

    def plan_schedule(self, steps: Sequence[int]) -> Schedule:
        """The program the plan beside ``steps`` simulates: this schedule, or, when at least half of
        them validated before stepping (``optim.speculate``: after a clipped or overflowed step), the
        same schedule with a synchronous optimizer (:func:`sysx.schedule.validate_first`)."""
        if not steps or 2 * len(self.validated_first.intersection(steps)) < len(steps):
            return self.schedule
        if self._validate_first is None:
            self._validate_first = validate_first(self.schedule)
        return self._validate_first

    def optimizer_settings(self, rollback: str) -> dict[str, Any]:
        """Fields of the rank optimizer's settings the device decides (none here); ``rollback``: the
        resolved ``optim.rollback`` (a modelled device charges an undo by it)."""
        return {}

    def gpus_per_node(self, local_world_size: int) -> int:
        """Ranks per node of the cluster the plan describes (here: this node's)."""
        return local_world_size

    def take_device_lane(self, lanes: Sequence[LaneTimes]) -> None:
        """Every rank's device-lane units (``optim.placement``): a modelled plan takes them in."""

    def sections(self) -> dict[str, Any]:
        """``summary.json`` sections of the device (collective on an emulated one)."""
        return {}

    def describe(self) -> list[str]:
        """Lines of the run header about the device (none here)."""
        return []


class EmulatedDeviceModel(DeviceModel):
    """``device=emulated``: the emulated cluster's plan of the run (see the module doc)."""

    models_memory = True  # the emulated GPU's memory is modelled; its stand-in holds tiny tensors

    def __init__(
        self,
        cfg: SysxConfig,
        schedule: Schedule,
        plan: EmulatedPlan,
        rank: int,
        *,
        group: dist.ProcessGroup | None,
        world: int,
        backend: str,
        layout: ReplicaLayout | None = None,
    ) -> None:
        stage_rank = rank if layout is None else layout.stage_rank
        pacer = EmulatedPacer(
            plan, schedule, rank, time_scale=cfg.emulate.time_scale, group=group, world=world, stage_rank=stage_rank
        )
        super().__init__(schedule, pacer)
        self.emulated_pacer = pacer
        self.replicas = 1 if layout is None else layout.replicas
        self.cfg, self.rank, self.group, self.world, self.backend = cfg, rank, group, world, backend
        self.plan: EmulatedPlan = plan
        self.lane_plan: tuple[float, float] | None = None
        self._validate_first_plan: EmulatedPlan | None = None

    @property
    def table(self) -> CostTable | None:
        """The emulated plan's cost table."""
        return self.plan.table

    def table_for(self, schedule: Schedule) -> CostTable | None:
        """The emulated cluster's costs of ``schedule``: the run's plan's, or those of the plan of its
        validating-first program (an optimizer that steps after VALIDATE runs on all of a rank's Adam
        threads at once, so its table differs from the asynchronous workers')."""
        return self.plan.table if schedule is self.schedule else self._plan_of(schedule).table

    def _plan_of(self, schedule: Schedule) -> EmulatedPlan:
        """The emulated plan of the validating-first program ``schedule`` (made once)."""
        if self._validate_first_plan is None:
            self._validate_first_plan = plan_emulation(self.cfg, schedule, backend=self.backend, replicas=self.replicas)
        return self._validate_first_plan

    def optimizer_settings(self, rollback: str) -> dict[str, Any]:
        """The emulated workers; their real work is small: one thread each."""
        self.emulated_pacer.rollback = rollback  # what an undo costs there (optim.rollback=auto resolved)
        return {"workers": self.plan.optimizer_workers, "threads_per_worker": 1}

    def gpus_per_node(self, local_world_size: int) -> int:
        """The emulated cluster's GPUs per node."""
        return self.plan.cluster.gpus_per_node

    def take_device_lane(self, lanes: Sequence[LaneTimes]) -> None:
        """With units on any rank's device lane, the plan the run is compared with takes the lane in
        (:func:`~sysx.emulate.costs.device_lane_plan`)."""
        if any(lanes):
            self.lane_plan = device_lane_plan(self.plan, self.schedule, lanes)

    def planned(self, steps: Sequence[int] = ()) -> tuple[float, float]:
        """The emulated plan's (iteration, bubble ratio) for ``steps`` (:meth:`plan_schedule`): with
        the device lane when units are on it and the steps speculated."""
        schedule = self.plan_schedule(steps)
        if schedule is self.schedule:
            return self.lane_plan or (self.plan.iteration, self.plan.bubble_ratio)
        p = self._plan_of(schedule)
        return p.iteration, p.bubble_ratio

    def sections(self) -> dict[str, Any]:
        """``{"emulation": report}`` (collective: every rank calls it; :meth:`report`)."""
        return {"emulation": self.report()}

    def report(self) -> dict[str, Any]:
        """The report of the steps so far, merged over the ranks (:func:`sysx.emulate.merge_report`),
        which rank 0 also prints (collective: every rank calls it)."""
        steps: list[Any] = [self.emulated_pacer.steps]
        if self.world > 1:
            steps = [None] * self.world
            dist.all_gather_object(steps, self.emulated_pacer.steps, group=self.group)
        plan, e = self.plan, self.cfg.emulate
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
        if self.replicas > 1:
            report["replicas"] = self._replica_report(steps, measured)
        if plan.disk_timeline is not None:
            report["nvme"] = self._disk_report(steps, measured)
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

    def _replica_report(self, steps: list[Any], measured: list[int]) -> dict[str, Any]:
        """The replicas' reductions and shard exchange per step, modelled by the run (the busiest
        rank's, over the measured steps) beside the plan's."""
        t, scale = self.plan.table, self.cfg.emulate.time_scale
        d, place = t.split, self.schedule.assignment
        plan_reduce = max(
            sum(t.reduce[s * d + k] for s, k in place.bwd_substages(r)) for r in range(self.schedule.n_ranks)
        )
        return {
            "replicas": self.replicas,
            "reduce_s": span_seconds(steps, measured, "RED ", scale),
            "gather_s": span_seconds(steps, measured, "GATHER", scale),
            "plan_reduce_s": plan_reduce if t.reduce else 0.0,
            "plan_gather_s": max(t.gather, default=0.0),
        }

    def _disk_report(self, steps: list[Any], measured: list[int]) -> dict[str, Any]:
        """The NVMe tier per step: the busiest rank's wait for reads, reads and writes (modelled
        seconds, as the run charged them) beside the plan's, and the plan's exposed I/O."""
        io, scale = self.plan.disk_timeline, self.cfg.emulate.time_scale
        assert io is not None
        return {
            "wait_s": span_seconds(steps, measured, "DISKWAIT ", scale),
            "read_s": span_seconds(steps, measured, "READ", scale),
            "write_s": span_seconds(steps, measured, "WRITE", scale),
            "plan_wait_s": max(io.wait, default=0.0),
            "plan_read_s": max(io.read, default=0.0),
            "plan_write_s": max(io.write, default=0.0),
            "plan_exposed_s": io.exposed,
            "plan_host_iteration_s": io.base,
        }

    def describe(self) -> list[str]:
        """The run header's line: cluster, costs, time scale and the plan."""
        iteration, bubble = self.planned()
        return [
            f"  emulated: {self.plan.describe()}; time x{self.pacer.time_scale:g}; plan {iteration:.3f} s/iteration, "
            f"bubble {100 * bubble:.1f}%" + (" (with the device lane)" if self.lane_plan else "")
        ]


def emulated_schedule(
    cfg: SysxConfig, build: ScheduleBuilder, *, backend: str, replicas: int | None = None
) -> tuple[Schedule, EmulatedPlan]:
    """The schedule of an emulated run, cut like the model it emulates (same layer count, the
    emulated sequence length), and the emulated plan of it run by ``replicas`` pipelines (None:
    ``parallel.replicas``; ``sysx plan`` plans the same)."""
    emulated = emulated_model(cfg)
    schedule = build(emulated.config, seq_len=emulated.seq_len)
    return schedule, plan_emulation(cfg, schedule, backend=backend, replicas=replicas)


def device_model(
    cfg: SysxConfig,
    model_cfg: ModelConfig,
    build: ScheduleBuilder,
    *,
    rank: int,
    group: dist.ProcessGroup | None,
    world: int,
    backend: str,
    layout: ReplicaLayout | None = None,
) -> DeviceModel:
    """The device model of ``cfg.device``, with the run's schedule made by ``build`` (see the module
    doc). ``backend``: the CPU Adam backend (``torch`` or ``deepspeed``), which sets the emulated
    optimizer workers. ``layout``: the job's replicas (None: one pipeline): ``build`` makes the
    P-rank schedule every replica runs, ``rank`` is the global rank (its pipeline rank indexes the
    plan's table; ``group`` and ``world`` span every replica, as the validation does) and the
    emulated nodes hold the global ranks. An emulated plan that overflows the emulated GPU's memory
    is a ConfigError."""
    if cfg.device != EMULATED_DEVICE:
        return DeviceModel(build(model_cfg, seq_len=cfg.train.seq_len))
    replicas = None if layout is None else layout.replicas
    schedule, plan = emulated_schedule(cfg, build, backend=backend, replicas=replicas)
    return EmulatedDeviceModel(cfg, schedule, plan, rank, group=group, world=world, backend=backend, layout=layout)
