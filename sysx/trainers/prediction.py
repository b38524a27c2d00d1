"""A pipeline run checks its prediction after its first steps (:mod:`sysx.autotune.check`).

Every rank calls :meth:`RunPrediction.after_step` after each step; at the check step (the same on
every rank) the ranks reduce their memory peaks, and rank 0 simulates the schedule with the costs
the run used, compares, prints the line (and the warning) and keeps the ``prediction`` section
for ``summary.json``. The measured iteration is the recorded window's when the timeline recorder
ran, else the mean of the logged step times after the warm-up.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from sysx import device as dev
from sysx.autotune.check import GPU, HOST, Prediction, check_step, compare, long_enough, measured_window, predict
from sysx.emulate.device_model import DeviceModel
from sysx.metrics import StepResult
from sysx.optim.threads import OptimizerThreads
from sysx.schedule import Schedule
from sysx.schedule.costs import Costs, CostTable
from sysx.trace.report import PipelineWindow


def _kib_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """Bytes of the ``name: N kB`` lines of a /proc file (missing: 0; not Linux: all 0)."""
    found = dict.fromkeys(names, 0)
    with contextlib.suppress(OSError, ValueError, IndexError), open(path, encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in found:
                found[key] = int(rest.split()[0]) * 1024
    return found


def _file_and_shared_excess() -> int:
    """What RSS counts beyond anonymous memory and this process's share of its shared memory:
    file pages (libraries, memory-mapped data: page cache any process may share and the kernel
    may drop) and shared-memory pages beyond their proportional share (PSS)."""
    status = _kib_fields("/proc/self/status", ("RssFile", "RssShmem"))
    pss_shm = _kib_fields("/proc/self/smaps_rollup", ("Pss_Shmem",))["Pss_Shmem"]
    return status["RssFile"] + status["RssShmem"] - pss_shm


def release_free_heap() -> bool:
    """Give the heap's free pages back to the kernel (glibc's ``malloc_trim``; False elsewhere).

    What a process freed before its training state was built (rank 0's profiling and search run
    the model's layers at every micro-batch size) stays resident in glibc's heap: counted in the
    baseline, and reused by the state's buffers and the backward's workspace, so that rank's growth
    would read tens of MiB less than every other rank's for the same plan (issue 27: 7 against 31
    MiB on the tiny model). Trimmed first, every rank's growth is its state's and its steps'."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


def import_backward_modules() -> None:
    """Import what torch imports at a process's first backward with given output gradients
    (``torch.autograd``'s ``_make_grads``: ``torch.fx.experimental.symbolic_shapes`` and sympy,
    ~30 MiB and 0.35 s), so that its modules are not read as the training state's growth. Not
    ``torch._dynamo``: a pipeline rank never imports it (0.9-1.0 s and 31-33 MiB a rank, measured)."""
    with contextlib.suppress(ImportError):  # another torch may keep it elsewhere: then it is not imported there
        import torch.fx.experimental.symbolic_shapes  # noqa: F401


def load_optimizer_op(backend: str) -> None:
    """Load DeepSpeed's cpu_adam op when a job with ``optim.backend=backend`` steps with it (its
    package and library, 21 MiB of a process's anonymous memory, measured), so that they are not
    read as the training state's growth; where it fails, the job's own load says so (``auto``
    falls back there)."""
    if backend == "torch":
        return
    from sysx.optim.deepspeed_backend import DeepSpeedUnavailable, load_op

    with contextlib.suppress(DeepSpeedUnavailable):
        load_op()


def start_host_peak(optim_backend: str = "torch") -> int:
    """The baseline of :func:`host_growth`: this process's anonymous memory plus its share of its
    shared memory (its RSS off Linux), with its peak (VmHWM) reset to its RSS (Linux >= 4.0,
    ``clear_refs`` 5), so the peak read later is the state's, not an earlier one's (rank 0's
    tuning measures copy rates with 64 MiB of buffers and searches thousands of candidates first).
    The libraries a job loads as it starts are loaded first: the backward's modules and the
    optimizer's op (``optim_backend``: the job's ``optim.backend``)."""
    import_backward_modules()
    load_optimizer_op(optim_backend)
    # not Linux, or not allowed: the peak since the start stands
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return dev.host_rss_bytes() - _file_and_shared_excess()


def host_growth(base: int) -> float:
    """This process's peak memory growth past ``base`` (:func:`start_host_peak`), counting its
    anonymous memory in full and its shared memory by its proportional share (PSS): summed over the
    ranks, a page of the node's shared working copy that several ranks map counts once, as the
    physical memory the node gives it and as the host plan's ``shm`` counts it. File pages
    (libraries, the memory-mapped dataset) are left out: page cache shared with every process that
    maps the same files, which the kernel may drop, and whose share would depend on unrelated
    processes. The peak is VmHWM less those pages now: they stay mapped from the state's build to
    the end of the run, so their residency now is their residency at the peak."""
    hwm = _kib_fields("/proc/self/status", ("VmHWM",))["VmHWM"]
    # VmHWM is this process's own peak; ru_maxrss (the fallback off Linux) survives an exec and
    # can be the launching process's
    peak = hwm or dev.host_peak_rss_bytes()
    return float(peak - _file_and_shared_excess() - base)


class AllReduce(Protocol):
    """``values`` reduced over the ranks (waited for in slices: a stop or a dead peer interrupts it)."""

    def __call__(self, values: list[float], what: str, op: dist.ReduceOp.RedOpType = ...) -> list[float]: ...


class RunCosts:
    """The costs a pipeline run's plans are simulated with, the first found: ``schedule.tune``'s
    (rank 0), the device's model (``device=emulated``), this machine's cached profile
    (:func:`sysx.autotune.apply.cached_costs`, looked up by ``lookup``), the recorded window's."""

    def __init__(
        self,
        tuned: Costs | None,
        modelled: Callable[[Schedule], CostTable | None],
        *,
        lookup: Callable[[], Costs | None],
        window: PipelineWindow,
    ) -> None:
        """``modelled``: the device's costs of a schedule (:meth:`sysx.emulate.device_model.DeviceModel.table_for`)."""
        self.tuned, self.modelled, self.lookup, self.window = tuned, modelled, lookup, window

    def plan_table(self, schedule: Schedule) -> CostTable | None:
        """The costs the plan beside a recorded timeline of ``schedule`` is simulated with; None: the
        window's own profiled costs (:func:`sysx.trace.costs.measured_costs`)."""
        return self.tuned.table(schedule) if self.tuned is not None else self.modelled(schedule)

    def costs(self, schedule: Schedule) -> tuple[Costs | CostTable | None, str]:
        """Rank 0: the costs ``schedule`` (the program the checked steps ran) is predicted with, and
        their name (see :mod:`sysx.autotune.check`)."""
        if self.tuned is not None:
            return self.tuned, "tuned profile"
        modelled = self.modelled(schedule)
        if modelled is not None:
            return modelled, "emulated device"
        cached = self.lookup()
        if cached is not None:
            return cached, "cached profile"
        window = self.window.costs
        return (window, "recorded window's costs") if window is not None else (None, "")


def cached_profile(
    cfg: Any, world: int, local_world_size: int, device: torch.device, threads: OptimizerThreads
) -> Callable[[], Costs | None]:
    """:func:`sysx.autotune.apply.cached_costs` of this run (with ``threads``' workers), looked up when called."""

    def lookup() -> Costs | None:
        from sysx.autotune.apply import cached_costs

        return cached_costs(
            cfg, world, local_world_size, device, workers=threads.workers, threads=threads.threads_per_worker or 1
        )

    return lookup


class RunPrediction:
    """The check of one rank of a pipeline run (built once the trainer is, before its first step):
    ``costs`` says what it was predicted with, ``model`` the device's plans, ``window`` the recorded
    window; ``all_reduce`` reduces the memory peaks over the ranks."""

    def __init__(
        self,
        costs: RunCosts,
        model: DeviceModel,
        window: PipelineWindow,
        all_reduce: AllReduce,
        *,
        rank: int,
        total_steps: int,
        device: torch.device,
        local_world_size: int,
        rss0: int,
    ) -> None:
        self.costs, self.model, self.window, self.all_reduce = costs, model, window, all_reduce
        self.rank, self.total_steps, self.device, self.local_world_size = rank, total_steps, device, local_world_size
        self.rss0 = rss0  # the RSS before the trainer built its state: the growth is what the plan describes
        self.step_times: list[tuple[int, float]] = []
        self.at: int | None = None  # set at the first step this process runs (after a resume, too)
        self.extended = False  # whether the window was checked against WINDOW_S (once, collectively)
        self.section: dict[str, Any] = {}

    def _memory_kind(self) -> str:
        if self.model.models_memory:
            return ""
        return GPU if dev.is_cuda(self.device) else HOST

    def _peak(self) -> float | None:
        """Collective: the fullest rank's GPU peak, or every rank's host growth summed (CPU)."""
        kind = self._memory_kind()
        if not kind:
            return None
        mine = float(dev.max_memory_allocated(self.device)) if kind == GPU else host_growth(self.rss0)
        # through the trainer's sliced wait: a signal or a dead peer during the check stops it
        (value,) = self.all_reduce(
            [mine], "prediction check (memory peaks)", op=dist.ReduceOp.MAX if kind == GPU else dist.ReduceOp.SUM
        )
        return float(value)

    def after_step(self, result: StepResult) -> None:
        """Note the step's time; at the check step, compare (collective at that step)."""
        self.step_times.append((result.step, result.step_time_s))
        if self.at is None:
            self.at = check_step(result.step, self.total_steps, self.window.last_step)
        if result.step != self.at:
            return
        if not self.extended and self.window.last_step is None:
            self.extended = True
            (slowest,) = self.all_reduce(
                [measured_window(self.step_times)[1]], "prediction check (step times)", op=dist.ReduceOp.MAX
            )
            self.at = long_enough(self.at, self.step_times, self.total_steps, float(slowest))
            if result.step != self.at:
                return
        peak = self._peak()
        if self.rank != 0:
            return
        recorded = self.window.iteration()
        if recorded is not None:
            (steps, iteration), how = recorded, "timeline"
        else:
            steps, iteration = measured_window(self.step_times)
            how = "step times"
        schedule = self.model.plan_schedule(steps)  # validating first after a clipped step runs another program
        costs, source = self.costs.costs(schedule)
        if costs is None:
            print(
                "prediction: none (no profile of this machine and model shape is cached; schedule.tune=true or "
                "`sysx tune` measures one)",
                flush=True,
            )
            return
        gpn = self.model.gpus_per_node(self.local_world_size)
        if schedule is not self.model.schedule:
            source = f"{source}, validating first"
        pred: Prediction = predict(schedule, costs, memory=self._memory_kind(), source=source, gpus_per_node=gpn)
        lane = self.model.lane_plan
        if self.costs.tuned is None and lane is not None and schedule is self.model.schedule:
            pred = dataclasses.replace(pred, iteration_s=lane[0], source=f"{source}, device lane included")
        self.section, lines = compare(pred, iteration, peak, steps=steps, measured_by=how)
        for line in lines:
            print(line, flush=True)


class SinglePrediction:
    """``schedule=single``: the planner's predicted step time and memory (its :class:`SinglePlan`)
    against the run's, after the same first steps (one process: nothing collective). The step is the
    later of the planner's passes and :attr:`optimizer_s`, when the optimizer stops holding the next
    passes (:attr:`sysx.optim.placement.Placement.finish`, set where the optimizer was placed)."""

    def __init__(self, plan: Any, device: torch.device, optim_backend: str = "torch") -> None:
        self.plan, self.device = plan, device
        self.optimizer_s = 0.0
        # the planner's op profiles run through torch's Python decompositions, which import
        # torch._dynamo (~30 MiB); imported here too, in case they did not, a later import is not
        # read as the step's growth (a pipeline rank never imports it: tests/test_host_costs.py)
        import torch._dynamo  # noqa: F401

        release_free_heap()
        self.rss0 = start_host_peak(optim_backend)
        self.step_times: list[tuple[int, float]] = []
        self.at: int | None = None
        self.extended = False
        self.section: dict[str, Any] = {}

    def after_step(self, result: StepResult, total_steps: int, recorded: tuple[int, int, float] | None) -> None:
        """Note the step; at the check step compare. ``recorded``: ``(first, last, seconds)`` of a
        written timeline window, else None."""
        self.step_times.append((result.step, result.step_time_s))
        if self.at is None:
            self.at = check_step(result.step, total_steps, None)
        if result.step != self.at:
            return
        if not self.extended and recorded is None:
            self.extended = True
            self.at = long_enough(self.at, self.step_times, total_steps, measured_window(self.step_times)[1])
            if result.step != self.at:
                return
        cuda = dev.is_cuda(self.device)
        dev_total = float(self.plan.device_bytes["total"])
        # on CPU the planner's device buffers are host memory too
        peak_plan = dev_total if cuda else dev_total + float(self.plan.host_bytes["total"])
        peak = float(dev.max_memory_allocated(self.device)) if cuda else host_growth(self.rss0)
        step = max(float(self.plan.times["step_s"]), self.optimizer_s)
        pred = Prediction(step, peak_plan, GPU if cuda else HOST, "single-device planner")
        if recorded is not None:
            steps, iteration, how = list(range(recorded[0], recorded[1] + 1)), recorded[2], "timeline"
        else:
            (steps, iteration), how = measured_window(self.step_times), "step times"
        self.section, lines = compare(pred, iteration, peak, steps=steps, measured_by=how)
        for line in lines:
            print(line, flush=True)
