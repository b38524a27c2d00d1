"""Choose a pipeline configuration by simulation (ProTrain's search, paper section 3.5).

Every candidate of the job's schedule family (forward stages per rank, SysX split ``d`` and
``cfg``, micro-batch size x micro-batches with the product, the global batch, fixed, GPU
parameter buffers, optimizer workers per rank) is built like a run builds it
(:func:`sysx.runtime.options.make_schedule`: partition, build, validate) and simulated with the
profiled :class:`~sysx.schedule.costs.Costs`. Candidates over the GPU, host or ``/dev/shm``
budget are rejected before anything runs; the rest are ranked by predicted iteration time.
When nothing fits, :mod:`sysx.autotune.advice` says what is closest and what change makes it fit.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from sysx.autotune.costs import profiled_costs
from sysx.autotune.nvme import exposed_io, tier_memory
from sysx.autotune.profile import MachineProfile
from sysx.autotune.replicas import node_memory, replica_costs, replica_counts
from sysx.config import ConfigError
from sysx.config.choices import ONE_STAGE_PER_RANK
from sysx.model import ModelConfig
from sysx.optim.nvme.cost import DiskRates
from sysx.partition import PartitionError
from sysx.runtime.options import PipelineOptions, block_layout, fits_block_stages, make_schedule
from sysx.schedule.costs import Costs
from sysx.schedule.ops import Schedule, ScheduleError
from sysx.schedule.simulate import Timeline, simulate

RESOURCES = ("gpu", "host", "shm", "disk")


@dataclass(frozen=True)
class Budget:
    """Bytes available: ``gpu`` per GPU, ``host`` RAM per node (optimizer state and the shared
    working copy both live there), ``shm`` the ``/dev/shm`` of a node, ``disk`` the free space of a
    node's ``optim.nvme_dir`` (``optim.offload=nvme``'s state files; unbounded by default)."""

    gpu: float
    host: float
    shm: float
    disk: float = math.inf


@dataclass(frozen=True)
class Job:
    """What the search may not change: model, sequence length, global batch, ranks, schedule family."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    n_ranks: int
    schedule: str = "sysx"
    gpus_per_node: int | None = None
    work_dtype: str = "bfloat16"
    optim_backend: str = "auto"
    rollback: str = "undo"  # optim.rollback: snapshot and exact keep a second (p, m, v) set in host memory
    replicas: int | None = 1  # data-parallel pipelines of n_ranks / replicas ranks (None: the search picks)
    offload: str = "host"  # optim.offload: nvme counts the state files and charges the exposed disk time
    disk: DiskRates | None = None  # a node's drives under optim.nvme_dir (None: no disk time charged)

    @property
    def ranks_per_node(self) -> int:
        """Ranks sharing one node's host memory and CPU threads."""
        return min(self.gpus_per_node or self.n_ranks, self.n_ranks)

    @property
    def pipeline_ranks(self) -> int:
        """Ranks of each replica's pipeline (the schedule's)."""
        return self.n_ranks // (self.replicas or 1)


@dataclass(frozen=True)
class Space:
    """The options searched (``None`` entries are left to :func:`make_schedule`'s fixed rule)."""

    stages_per_rank: tuple[int, ...] = (1, 2, 3, 4)
    splits: tuple[int, ...] = (1, 2, 3)
    # sysx cfg 2-3 also at one block per forward stage (the runtime's default layout; its stages per
    # rank are no whole number, so it keeps stages_per_rank and split null)
    block_stages: bool = True
    cfgs: tuple[int, ...] = (0, 1, 2, 3)  # sysx ablation configs: lower ones hold fewer checkpoints in flight
    param_buffers: tuple[int, ...] = (1, 2, 3)
    micro_batch_sizes: tuple[int, ...] | None = None  # None: every divisor of the global batch
    optimizer_workers: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to the rank's threads


@dataclass
class Candidate:
    """One configuration and its prediction (times in seconds, memory in bytes)."""

    options: PipelineOptions
    micro_batch_size: int
    micro_batches: int
    threads_per_worker: int
    iteration: float
    bubble: float
    gpu: float  # peak GPU bytes of the fullest rank
    gpu_parts: dict[str, float]  # that rank's peaks: params, grads, ckpts, work
    host: float  # host bytes of the fullest node: optimizer state + shared working copy
    shm: float  # /dev/shm bytes of the fullest node
    over: dict[str, float] = field(default_factory=dict)  # need / budget per resource
    replicas: int = 1  # data-parallel pipelines; micro_batches is each one's
    exposed_io: float = 0.0  # optim.offload=nvme: seconds of disk I/O the iteration cannot hide (in iteration)
    instructions: int = 0  # ops a step of the fullest rank's list runs (the tie-break of :func:`search`)

    @property
    def global_batch(self) -> int:
        """Sequences per iteration of every replica together (what the search keeps fixed)."""
        return self.replicas * self.micro_batch_size * self.micro_batches

    @property
    def fits(self) -> bool:
        """Within every budget."""
        return all(x <= 1.0 for x in self.over.values())

    @property
    def worst(self) -> float:
        """The largest need / budget ratio (<= 1 when it fits)."""
        return max(self.over.values(), default=0.0)

    def label(self) -> str:
        """The options in ``key=value`` form, as the config spells them."""
        o = self.options
        parts = [f"schedule={o.schedule}"] + ([f"parallel.replicas={self.replicas}"] if self.replicas > 1 else [])
        if o.schedule not in ONE_STAGE_PER_RANK:
            parts.append(f"stages_per_rank={_spelled(o.stages_per_rank)}")
        if o.schedule == "sysx":
            parts += [f"split={_spelled(o.split)}", f"cfg={o.cfg}"]
        parts += [
            f"micro_batch_size={self.micro_batch_size}",
            f"micro_batches={self.micro_batches}",
            f"param_buffers={o.param_buffers}",
            f"optim.workers={o.optimizer_workers}",
        ]
        return " ".join(parts)


def _spelled(value: int | None) -> str:
    """A layout key as the config spells it (null: the runtime's one block per stage)."""
    return "null" if value is None else str(value)


@dataclass
class Result:
    """What :func:`search` found: fitting candidates fastest first, the rejected ones, and why."""

    job: Job
    budget: Budget
    fitting: list[Candidate]
    rejected: list[Candidate]
    invalid: list[str]  # candidates that cannot be built, with the reason

    @property
    def best(self) -> Candidate | None:
        """The fastest fitting candidate."""
        return self.fitting[0] if self.fitting else None

    @property
    def closest(self) -> Candidate | None:
        """The candidate least over budget (the answer when nothing fits)."""
        return min(self.rejected, key=lambda c: (c.worst, c.iteration), default=None)


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


def thread_options(job: Job, profile: MachineProfile, space: Space) -> list[tuple[int, int]]:
    """``(optimizer workers, threads each)`` per rank, split like :func:`sysx.optim.cores.plan_cores`:
    the node's physical cores evenly over its ranks; the torch backend's workers share a rank's
    cores, a DeepSpeed worker (it holds the GIL) uses all of them and more workers would not overlap."""
    per_rank = max(1, profile.cpu_threads // job.ranks_per_node)
    torch_backend = job.optim_backend == "torch"
    default = tuple(w for w in (1, 2, 4, 8, 16) if w <= per_rank) if torch_backend else (1,)
    return [(w, max(1, per_rank // w) if torch_backend else per_rank) for w in space.optimizer_workers or default]


def _options(job: Job, space: Space) -> Iterator[PipelineOptions]:
    """Schedule options of the job's family, without duplicates the family ignores."""
    one = job.schedule in ONE_STAGE_PER_RANK
    per_rank: tuple[int | None, ...] = (None,) if one else space.stages_per_rank
    cfgs = space.cfgs if job.schedule == "sysx" else (3,)
    blocks = job.schedule == "sysx" and space.block_stages
    blocks = blocks and fits_block_stages(job.model.n_layers + 2, job.pipeline_ranks)
    for p, c, b in itertools.product(per_rank, cfgs, space.param_buffers):
        # other schedules and CFG0 run whole-stage backwards: d is 1 there
        splits: tuple[int | None, ...] = space.splits if job.schedule == "sysx" and c > 0 else (None,)
        if blocks and p == per_rank[0] and c >= 2:  # once per cfg and buffer count
            yield PipelineOptions(schedule="sysx", cfg=c, param_buffers=b, optim_backend=job.optim_backend)
        for d in splits:
            yield PipelineOptions(
                schedule=job.schedule,
                stages_per_rank=p,
                split=d,
                cfg=c,
                param_buffers=b,
                optim_backend=job.optim_backend,
            )


def evaluate(
    job: Job, budget: Budget, profile: MachineProfile, opts: PipelineOptions, mbs: int, workers: int, threads: int
) -> Candidate:
    """Build, validate and simulate one candidate; its memory against ``budget``.

    Raises ``ScheduleError``, ``PartitionError`` or ``ConfigError`` when it cannot be built.
    """
    built, sched = _build(job, opts, mbs)
    return _simulated(job, budget, profile, built, sched, mbs, workers, threads)


def _build(job: Job, opts: PipelineOptions, mbs: int) -> tuple[PipelineOptions, Schedule]:
    """The options as built (the fixed rule's choices filled in) and the validated schedule; the
    optimizer workers do not change the schedule, so the search builds it once for all of them."""
    opts = PipelineOptions(**opts.__dict__)
    n_micro = job.global_batch // (job.replicas or 1) // mbs  # each replica's
    sched = make_schedule(
        opts,
        job.model,
        n_ranks=job.pipeline_ranks,
        n_micro=n_micro,
        seq_len=job.seq_len,
        ranks_per_node=job.ranks_per_node,
        spread_allowed=job.replicas == 1 and job.offload == "host",  # replicas None: the search picks R > 1 too
        micro_batch_size=mbs,
    )
    if block_layout(opts, sched, job.model):  # no whole number of stages per rank: null keeps the rule's
        return opts, sched
    if opts.schedule not in ONE_STAGE_PER_RANK:  # the values the fixed rule chose, so the label says what runs
        opts.stages_per_rank = sched.n_stages // job.pipeline_ranks
    if opts.schedule == "sysx":
        opts.split = sched.split
    return opts, sched


def _simulated(
    job: Job,
    budget: Budget,
    profile: MachineProfile,
    opts: PipelineOptions,
    sched: Schedule,
    mbs: int,
    workers: int,
    threads: int,
) -> Candidate:
    opts = PipelineOptions(**{**opts.__dict__, "optimizer_workers": workers})
    tl = simulate(
        sched, candidate_costs(job, profile, mbs, workers, threads), record=False, gpus_per_node=job.ranks_per_node
    )
    r = job.replicas or 1
    nodes = None  # one replica: the timeline's host memory, as always
    tier = (0.0, 0.0)
    if job.offload == "nvme":
        host, shm, disk, io = tier_memory(
            sched, job.model, r, job.ranks_per_node, work_dtype=job.work_dtype, rollback=job.rollback
        )
        nodes, tier = (host, shm), (disk, exposed_io(job.disk, io, tl.iteration))
    elif r > 1:
        nodes = node_memory(sched, job.model, r, job.ranks_per_node, work_dtype=job.work_dtype, rollback=job.rollback)
    cand = _candidate(job, budget, opts, mbs, job.global_batch // r // mbs, threads, tl, nodes, tier)
    return dataclasses.replace(cand, instructions=max(len(ops) for ops in sched.ops))


def candidate_costs(job: Job, profile: MachineProfile, mbs: int, workers: int, threads: int) -> Costs:
    """The :class:`Costs` a candidate is simulated with (and a tuned run's prediction, :mod:`sysx.autotune.check`)."""
    return profiled_costs(
        profile,
        job.model,
        job.seq_len,
        mbs,
        work_dtype=job.work_dtype,
        optim_workers=workers,
        threads_per_worker=threads,
        gpus_per_node=job.ranks_per_node,
        rollback=job.rollback,
        world=job.n_ranks,
        replica=replica_costs(
            job.replicas or 1, job.pipeline_ranks, job.ranks_per_node, profile, work_dtype=job.work_dtype
        ),
    )


def _candidate(
    job: Job,
    budget: Budget,
    opts: PipelineOptions,
    mbs: int,
    n_micro: int,
    threads: int,
    tl: Timeline,
    nodes: tuple[float, float] | None = None,
    tier: tuple[float, float] = (0.0, 0.0),
) -> Candidate:
    """``nodes``: the fullest node's (host, shm) bytes with replicas or the tier (None: the timeline's);
    ``tier``: the fullest node's state-file bytes and the iteration's exposed disk seconds."""
    gpn = tl.gpus_per_node
    top = max(range(tl.n_ranks), key=lambda r: tl.peak_gpu[r])
    node_host = [sum(tl.host[i * gpn : (i + 1) * gpn]) + tl.shm[i] for i in range(len(tl.shm))]
    host, shm = nodes or (max(node_host), max(tl.shm))
    parts = {
        "params": tl.peak_params[top],
        "grads": tl.peak_grads[top],
        "ckpts": tl.peak_ckpts[top],
        "work": tl.peak_work[top],
    }
    over = {"gpu": tl.peak_gpu[top] / budget.gpu, "host": host / budget.host, "shm": shm / budget.shm}
    over["disk"] = tier[0] / budget.disk
    return Candidate(
        opts,
        mbs,
        n_micro,
        threads,
        tl.iteration + tier[1],
        tl.bubble_ratio,
        tl.peak_gpu[top],
        parts,
        host,
        shm,
        over,
        tl.replicas,
        tier[1],
    )


def search(job: Job, budget: Budget, profile: MachineProfile, space: Space = Space()) -> Result:
    """Every candidate of ``space`` (and, with ``job.replicas`` None, every replica count that divides
    the ranks and the global batch): fitting ones ranked by predicted time per global batch."""
    fitting: list[Candidate] = []
    rejected: list[Candidate] = []
    invalid: list[str] = []
    for r in replica_counts(job.n_ranks, job.global_batch, job.replicas):
        one = job if job.replicas == r else dataclasses.replace(job, replicas=r)
        if job.n_ranks % r or job.global_batch % r:
            invalid.append(f"parallel.replicas={r} does not divide the {job.n_ranks} ranks and the global batch")
            continue
        _search_layouts(one, budget, profile, space, (fitting, rejected, invalid))
    # equal times: the one needing less memory and fewer buffers and workers
    fitting.sort(key=lambda c: (c.iteration, c.gpu, c.host, c.options.param_buffers, c.options.optimizer_workers or 0))
    return Result(job, budget, fewest_instructions_first(fitting, tie(profile)), rejected, invalid)


# Predicted times this close to the fastest are a tie: every instruction costs the host more than the
# model charges (on the 2-core CPU the top candidates for a tiny 2-replica job were tied to 0.1 ms, and
# a layout of 49 instructions a step planned 2% from one of 19 ran 12% slower: VALIDATE's, the
# optimizer's and the copies' fixed costs per unit and per op), so the tie goes to the fewest instructions.
# On a measured machine the band is TIE_MEASURED: the same tiny job's layout with two stages a rank,
# planned 0.2% under one stage, ran 3% longer (median of 6 interleaved pairs), and the tuned runs that
# picked it, each planned over 1% under one stage, ran a median 13% over their plans (21 runs),
# those with one stage 4% (41 runs; issue 27, twenty-sixth session).
# On an assumed (emulated) machine the plan is the emulator's own cost model: TIE.
TIE = 0.01
TIE_MEASURED = 0.03


def tie(profile: MachineProfile) -> float:
    """The band of predicted times :func:`fewest_instructions_first` treats as equal on ``profile``'s machine."""
    return TIE_MEASURED if profile.hardware.measured else TIE


def fewest_instructions_first(ranked: list[Candidate], band: float = TIE) -> list[Candidate]:
    """``ranked`` (fastest first) with the candidates within ``band`` (a fraction) of the fastest
    ordered by the fewest instructions per step of their fullest rank, then as ranked."""
    if not ranked:
        return ranked
    limit = ranked[0].iteration * (1 + band)
    near = sorted((c for c in ranked if c.iteration <= limit), key=lambda c: c.instructions)  # stable: as ranked
    return near + [c for c in ranked if c.iteration > limit]


def _search_layouts(
    job: Job,
    budget: Budget,
    profile: MachineProfile,
    space: Space,
    out: tuple[list[Candidate], list[Candidate], list[str]],
) -> None:
    """The candidates of ``space`` at ``job``'s replica count into ``out`` (fitting, rejected, invalid)."""
    fitting, rejected, invalid = out
    per_replica = job.global_batch // (job.replicas or 1)
    sizes = space.micro_batch_sizes or tuple(divisors(per_replica))
    for mbs in sizes:
        if per_replica % mbs:
            invalid.append(f"micro_batch_size={mbs} does not divide the global batch {job.global_batch}")
            continue
        for opts in _options(job, space):
            try:
                built, sched = _build(job, opts, mbs)
            except (ScheduleError, PartitionError, ConfigError) as err:
                invalid.append(f"{opts.describe()} micro_batch_size={mbs}: {err}")
                continue
            for workers, threads in thread_options(job, profile, space):
                cand = _simulated(job, budget, profile, built, sched, mbs, workers, threads)
                (fitting if cand.fits else rejected).append(cand)
