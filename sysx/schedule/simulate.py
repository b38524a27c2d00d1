"""Execute a schedule's op lists on a model of the machine: timeline, bubble ratio, memory.

Every rank runs its list in order on one cursor (its compute stream), with copy streams, messages,
CPU optimizer workers and the VALIDATE barrier modelled beside it; the engine that executes the
lists is :mod:`sysx.schedule.engine`, and this module turns its output into a :class:`Timeline`.
With :class:`~sysx.schedule.costs.UnitCosts` this is the unit-cost model of the paper.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate, chain
from operator import itemgetter

from sysx.schedule.costs import Costs, CostTable, UnitCosts
from sysx.schedule.engine import CKPTS, GRADS, PARAMS, PROGRAMS, REDUCE, WORK, run_program
from sysx.schedule.ops import Op, Schedule


@dataclass(frozen=True, slots=True)
class Event:
    """One box of the timeline: ``op`` ran on ``rank``'s ``lane`` from ``start`` to ``end``.

    Transfers between ranks are events of the sender's ``p2p`` lane (``op`` is the SEND).
    """

    rank: int
    lane: str
    op: Op
    start: float
    end: float


@dataclass
class Timeline:
    """What :func:`simulate` returns (times in the cost model's unit, memory in bytes or units)."""

    name: str
    n_ranks: int
    iteration: float
    busy: list[float]
    bubble: list[float]
    bubble_ratio: float
    gpu_end: list[float]
    peak_gpu: list[float]
    peak_params: list[float]
    peak_grads: list[float]
    peak_ckpts: list[float]
    peak_work: list[float]
    host: list[float]
    shm: list[float]
    gpus_per_node: int
    unit: str
    events: list[Event] = field(default_factory=list)
    schedule: Schedule | None = None
    replicas: int = 1  # data-parallel replicas of this pipeline (the timeline is each one's)

    def summary(self) -> dict:
        """JSON-ready numbers (no events)."""
        return {
            "schedule": self.name,
            "ranks": self.n_ranks,
            "iteration": self.iteration,
            "bubble_ratio": self.bubble_ratio,
            "busy": self.busy,
            "bubble": self.bubble,
            "idle": [self.iteration - b for b in self.busy],
            "gpu_end": self.gpu_end,
            "peak_gpu": self.peak_gpu,
            "peak_params": self.peak_params,
            "peak_grads": self.peak_grads,
            "peak_ckpts": self.peak_ckpts,
            "peak_work": self.peak_work,
            "host_per_rank": self.host,
            "shm_per_node": self.shm,
            "gpus_per_node": self.gpus_per_node,
            "unit": self.unit,
            "replicas": self.replicas,
        }


def _peaks(mem: tuple[list[tuple[float, float]], ...]) -> tuple[float, list[float]]:
    """Peak of the running total of all deltas, and of each category's, in (time, delta) order
    (at equal times frees first). Sorting plain tuples and summing with ``accumulate`` keeps the
    sweep in C; deltas with equal keys are equal, so the order among them changes no sum."""
    for deltas in mem:
        deltas.sort()
    cat_peaks = [max(accumulate(map(itemgetter(1), deltas), initial=0.0)) for deltas in mem]
    # the categories are sorted runs already: this sort only merges them
    merged = sorted(chain.from_iterable(mem))
    return max(accumulate(map(itemgetter(1), merged), initial=0.0)), cat_peaks


def host_memory(schedule: Schedule, tab: CostTable, gpus_per_node: int) -> tuple[list[float], list[float]]:
    """Host bytes per rank (owned sub-stages' optimizer state: its 1/R shard with replicas; and the
    process's fixed bytes, ``tab.process_bytes``) and shared bytes per node."""
    p, pl = schedule.partition, schedule.assignment
    d = p.split
    host = [tab.process_bytes] * schedule.n_ranks
    n_nodes = (schedule.n_ranks + gpus_per_node - 1) // gpus_per_node
    layers: list[set[int]] = [set() for _ in range(n_nodes)]
    for s in range(p.n_stages):
        layers[pl.fwd_rank[s] // gpus_per_node].update(p.stage_layers(s))
        for k in range(d):
            r = pl.bwd_rank[s][k]
            host[r] += tab.params_sub[s * d + k] * tab.host_bytes_per_param / tab.replicas
            layers[r // gpus_per_node].update(p.sub_layers(s, k))
    # shared memory per node: the 16-bit copy of every layer a rank of the node owns or runs forward
    per_layer = [0.0] * p.n_layers
    for s in range(p.n_stages):
        for k in range(d):
            rng = p.sub_layers(s, k)
            share = tab.params_sub[s * d + k] * tab.param_bytes / max(1, len(rng))
            for i in rng:
                per_layer[i] = share
    shm = [sum(per_layer[i] for i in ls) for ls in layers]
    return host, shm


def host_bound(schedule: Schedule, tab: CostTable, busy: list[float], gpus_per_node: int) -> float:
    """The shortest step the node's cores allow (0 without ``tab.host_lane``): every rank of a node
    (and each replica's copy of it) spends CPU time on its compute where compute runs on the host,
    on every instruction, and on its optimizer steps and gradient reductions; a node cannot finish
    that work faster than its cores do it all. The timeline charges each rank its own lanes, which
    run side by side; on a CPU node with more work than cores they do not (issue 27)."""
    lane = tab.host_lane
    if lane is None:
        return 0.0
    d, place = tab.split, schedule.assignment
    node_cpu: dict[int, float] = {}
    for r, ops in enumerate(schedule.ops):
        owned = [s * d + k for s, k in place.bwd_substages(r)]
        cpu = lane.compute_cpu * busy[r] + lane.op_cpu * len(ops) + lane.opt_threads * sum(tab.opt[g] for g in owned)
        cpu += sum(tab.reduce[g] for g in owned) if tab.reduce else 0.0
        node_cpu[r // gpus_per_node] = node_cpu.get(r // gpus_per_node, 0.0) + cpu
    return max(node_cpu.values(), default=0.0) * lane.copies / lane.cores


CostsLike = Costs | UnitCosts | CostTable


def simulate(
    schedule: Schedule,
    costs: CostsLike | None = None,
    *,
    record: bool = True,
    memory: bool = True,
    rendezvous: bool | None = None,
    gpus_per_node: int | None = None,
) -> Timeline:
    """Run ``schedule`` under ``costs`` (unit costs 1/2/0 by default) and return its timeline.

    ``record=False`` skips the per-op events and ``memory=False`` the memory sweep (faster, for
    configuration searches). ``rendezvous`` overrides the costs' send semantics.
    ``gpus_per_node`` groups ranks into nodes for shared memory (default: all on one node).
    """
    tab = (costs or UnitCosts()).table(schedule) if not isinstance(costs, CostTable) else costs
    rv = tab.rendezvous if rendezvous is None else rendezvous
    out = run_program(schedule, tab, rendezvous=rv, record=record, memory=memory, posted=tab.posted_sends)
    R = schedule.n_ranks
    it = out["iteration"]
    if tab.gather:  # replicas: each rank's exchange of its updated shards ends its step
        it = max(it, *(end + g for end, g in zip(out["rank_end"], tab.gather)))
        if record:
            last = [len(ops) - 1 for ops in schedule.ops]
            out["events"] += [
                (r, REDUCE, last[r], e, e + g) for r, (e, g) in enumerate(zip(out["rank_end"], tab.gather)) if g > 0
            ]
    busy = out["busy"]
    gpn = gpus_per_node or R
    it = max(it, host_bound(schedule, tab, busy, gpn))
    bubble = [(it - b) / it if it > 0 else 0.0 for b in busy]
    ratio = (it * R - sum(busy)) / (it * R) if it > 0 else 0.0
    peaks = [0.0] * R
    cats = [[0.0] * R for _ in range(4)]
    if memory:
        for r in range(R):
            pk, cp = _peaks(out["mem"][r])
            peaks[r] = pk
            for k in range(4):
                cats[k][r] = cp[k]
    host, shm = host_memory(schedule, tab, gpn)
    events: list[Event] = []
    if record:
        ops, transfer = schedule.ops, PROGRAMS.get(schedule).transfer_op
        events = [Event(r, lane, ops[r][i] if i >= 0 else transfer[~i], st, en) for r, lane, i, st, en in out["events"]]
    return Timeline(
        schedule.name,
        R,
        it,
        busy,
        bubble,
        ratio,
        out["gpu_end"],
        peaks,
        cats[PARAMS],
        cats[GRADS],
        cats[CKPTS],
        cats[WORK],
        host,
        shm,
        gpn,
        tab.unit,
        events,
        schedule,
        tab.replicas,
    )
