"""Costs for :func:`sysx.schedule.simulate.simulate`: unit costs (the paper's figures) and
physical costs (per-layer times, bandwidths, CPU optimizer throughput, memory sizes).

Both resolve, for one schedule, into a :class:`CostTable` of per-stage / per-sub-stage numbers
(durations and the sizes of the memory model), which is all the simulator reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sysx.memory.budget import training_state_bytes
from sysx.partition import Partition
from sysx.schedule.ops import SENDS, Message, Schedule
from sysx.schedule.replica_costs import ReplicaCosts

HOST_BYTES_PER_PARAM = float(training_state_bytes("bfloat16").optimizer)  # its shared working copy is counted apart


@dataclass(frozen=True)
class HostLane:
    """The node's CPU cores as one lane every rank of the node draws on (:func:`~sysx.schedule.simulate.host_bound`).

    ``cores``: physical cores of a node. ``compute_cpu``: CPU seconds one second of simulated
    compute costs the node (0 where compute runs on a GPU; on a CPU "device" the CPU time of a pass
    over its simulated time, which the contention slowdown stretched). ``op_cpu``: CPU seconds of
    one executor instruction. ``opt_threads``: threads one optimizer step runs on (its CPU seconds
    are its time times these). ``copies``: ranks of the node per pipeline rank on it (the replicas
    that share the node run the same lists)."""

    cores: float
    compute_cpu: float = 0.0
    op_cpu: float = 0.0
    opt_threads: int = 1
    copies: int = 1

    def __post_init__(self) -> None:
        if not self.cores > 0:
            raise ValueError(f"HostLane.cores={self.cores!r} must be > 0 (the node's physical cores)")
        if not (self.compute_cpu >= 0 and self.op_cpu >= 0 and self.opt_threads >= 1 and self.copies >= 1):
            raise ValueError(f"HostLane: compute_cpu, op_cpu must be >= 0, opt_threads and copies >= 1, not {self}")


@dataclass
class CostTable:
    """Per-stage durations (s or units) and sizes (bytes or units) for one schedule.

    Sub-stage arrays are indexed by ``s * split + k``; unit (parameter buffer) arrays by stage for
    whole-stage units (``*_stage``) and by ``s * split + k`` for sub-stage units (``*_sub``).
    """

    split: int
    fwd: list[float]
    bwd: list[float]
    opt: list[float]
    load_stage: list[float]
    load_sub: list[float]
    offload: list[float]
    act_xfer: list[float]
    grad_xfer: list[float]
    ckpt_xfer: list[float]
    allreduce: float = 0.0
    param_stage: list[float] = field(default_factory=list)
    param_sub: list[float] = field(default_factory=list)
    grad_mem: list[float] = field(default_factory=list)
    ckpt_mem: list[float] = field(default_factory=list)
    fwd_work: list[float] = field(default_factory=list)
    bwd_work: list[float] = field(default_factory=list)
    host_bytes_per_param: float = HOST_BYTES_PER_PARAM
    param_bytes: float = 2.0
    params_stage: list[float] = field(default_factory=list)
    params_sub: list[float] = field(default_factory=list)
    rendezvous: bool = False
    optim_workers: int | None = None
    unit: str = "s"
    posted_sends: bool = False
    # replicas (:mod:`sysx.schedule.replica_costs`): each unit's gradient reduction (by sub-stage; empty:
    # one replica) and each rank's exchange of its updated shards after the step (by rank; empty: none)
    reduce: list[float] = field(default_factory=list)
    gather: list[float] = field(default_factory=list)
    replicas: int = 1
    op_host: float = 0.0  # the executor's fixed host cost of every instruction, on the rank's cursor
    # the Head's input gradient, a forward's FLOPs: where the schedule moves it to the Head's forward
    # (ScheduleOptions.head_igrad), that forward takes it on and the Head's backward sheds it
    head_igrad: float = 0.0
    process_bytes: float = 0.0  # host bytes every rank's process holds besides its training state
    host_lane: HostLane | None = None  # None: the ranks' host work is not bounded by the node's cores


@dataclass(frozen=True)
class UnitCosts:
    """The paper's unit-cost model (how its figures are checked).

    A forward stage on one micro-batch costs ``t_fwd``; the whole backward of a forward stage
    (recompute included) ``t_bwd``, so a SysX sub-stage ``t_bwd / d``; the optimizer step of a
    forward stage ``t_opt`` (a sub-stage ``t_opt / d``); communication and copies cost 0.
    Memory is counted in units: one stage's parameters = 1, one checkpoint = 1.
    """

    t_fwd: float = 1.0
    t_bwd: float = 2.0
    t_opt: float = 0.0
    optim_workers: int | None = None

    def table(self, schedule: Schedule) -> CostTable:
        """Resolve for ``schedule``."""
        p = schedule.partition
        nsf, d = p.n_stages, p.split
        nsub = nsf * d
        zero_s, zero_b = [0.0] * nsf, [0.0] * nsub
        return CostTable(
            split=d,
            fwd=[float(self.t_fwd)] * nsf,
            bwd=[self.t_bwd / d] * nsub,
            opt=[self.t_opt / d] * nsub,
            load_stage=zero_s,
            load_sub=zero_b,
            offload=zero_b,
            act_xfer=zero_s,
            grad_xfer=zero_b,
            ckpt_xfer=zero_b,
            allreduce=0.0,
            param_stage=[1.0] * nsf,
            param_sub=[1.0 / d] * nsub,
            grad_mem=[1.0 / d] * nsub,
            ckpt_mem=[1.0] * nsub,
            fwd_work=zero_s,
            bwd_work=zero_b,
            host_bytes_per_param=1.0,
            param_bytes=1.0,
            params_stage=[1.0] * nsf,
            params_sub=[1.0 / d] * nsub,
            rendezvous=False,
            optim_workers=self.optim_workers,
            unit="units",
        )


@dataclass(frozen=True)
class Costs:
    """Physical costs per flat layer ``[Embedding, Block x L, Head]`` (times in seconds).

    ``layer_fwd_time``: forward time of each layer on one micro-batch. Backward of a layer costs
    ``bwd_ratio`` x forward, plus one forward when ``recompute``. ``layer_params``: parameters per
    layer. ``act_bytes``: one boundary activation (micro-batch x seq x dim x dtype): the size of
    sent activations, input gradients and checkpoints. ``input_bytes``: the token ids (stage 0's
    checkpoint). ``layer_act_bytes``: activations one layer keeps for its backward. With
    ``gpus_per_node``, messages between ranks of different nodes (rank // gpus_per_node) take
    ``inter_p2p_latency`` + bytes / ``inter_p2p_bandwidth`` instead of the ``p2p_*`` figures. Send
    semantics (:mod:`sysx.schedule.simulate`): eager by default, ``rendezvous`` or ``posted_sends``.
    ``replica``: the data-parallel replicas of the pipeline (None: one), which divide the optimizer
    time and add the reductions and the shard exchange (:class:`ReplicaCosts`). ``op_host``: the
    executor's fixed host seconds per instruction, charged on the rank's cursor before every op
    (the per-message cost is the latency part of ``p2p_latency``). ``process_bytes``: host memory
    every rank's process holds besides its training state (its host plan adds it).
    ``bwd_once_bytes``: what a sub-stage's backward holds once beside its layers' activations (the
    backward's own temporaries; measured on a CPU "device", 0 otherwise). ``host_lane``:
    the node's cores every rank's host work shares (None: unbounded).
    """

    layer_fwd_time: tuple[float, ...]
    layer_params: tuple[float, ...]
    act_bytes: float
    layer_act_bytes: tuple[float, ...] = ()
    input_bytes: float = 0.0
    bwd_ratio: float = 2.0
    recompute: bool = True
    param_bytes: float = 2.0
    grad_bytes: float = 2.0
    host_bytes_per_param: float = HOST_BYTES_PER_PARAM
    p2p_latency: float = 20e-6
    p2p_bandwidth: float = 10e9
    h2d_bandwidth: float = 12e9
    d2h_bandwidth: float = 12e9
    optim_params_per_s: float = 2e9
    optim_workers: int | None = None
    allreduce_latency: float = 100e-6
    rendezvous: bool = False
    posted_sends: bool = False
    gpus_per_node: int | None = None
    inter_p2p_bandwidth: float | None = None
    inter_p2p_latency: float | None = None
    replica: ReplicaCosts | None = None
    op_host: float = 0.0
    process_bytes: float = 0.0
    bwd_once_bytes: float = 0.0
    host_lane: HostLane | None = None

    def __post_init__(self) -> None:
        n = len(self.layer_fwd_time)
        if len(self.layer_params) != n:
            raise ValueError(
                f"Costs: {len(self.layer_params)} layer_params for {n} layer_fwd_time entries; give one per layer"
            )
        if self.layer_act_bytes and len(self.layer_act_bytes) != n:
            raise ValueError(
                f"Costs: {len(self.layer_act_bytes)} layer_act_bytes for {n} layers; give one per layer or none"
            )
        if not self.op_host >= 0:
            raise ValueError(f"Costs.op_host={self.op_host!r} must be >= 0 (seconds per instruction)")
        for name in ("p2p_bandwidth", "h2d_bandwidth", "d2h_bandwidth", "optim_params_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Costs.{name}={getattr(self, name)!r} must be > 0")
        if self.inter_p2p_bandwidth is not None and not self.inter_p2p_bandwidth > 0:
            raise ValueError(f"Costs.inter_p2p_bandwidth={self.inter_p2p_bandwidth!r} must be > 0 or None")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"Costs.gpus_per_node={self.gpus_per_node!r} must be >= 1 or None (one node)")
        if self.optim_workers is not None and self.optim_workers < 1:
            raise ValueError(f"Costs.optim_workers={self.optim_workers!r} must be >= 1 or None (unlimited)")

    def table(self, schedule: Schedule) -> CostTable:
        """Resolve for ``schedule`` (its partition must cover these layers)."""
        p: Partition = schedule.partition
        if p.n_layers != len(self.layer_fwd_time):
            raise ValueError(
                f"the schedule's partition has {p.n_layers} layers but the costs describe "
                f"{len(self.layer_fwd_time)}; build both from the same model"
            )
        nsf, d = p.n_stages, p.split
        ft, pr = self.layer_fwd_time, self.layer_params
        act = self.layer_act_bytes or (0.0,) * p.n_layers
        # a schedule that keeps its activations backpropagates the forward's graph: no recompute, and
        # what a micro-batch holds from its forward to its backward is every layer's activations
        keep = schedule.options.keep_activations
        bmul = self.bwd_ratio + (1.0 if self.recompute and not keep else 0.0)

        def tsum(arr: Sequence[float], rng: range) -> float:
            return float(sum(arr[i] for i in rng))

        stages = [p.stage_layers(s) for s in range(nsf)]
        subs = [p.sub_layers(s, k) for s in range(nsf) for k in range(d)]
        ckpt_b = [self.input_bytes if r.start == 0 else self.act_bytes for r in subs]
        crossing = self._crossing(schedule)

        def xfer(family: Message, i: int, nbytes: float) -> float:
            if (family, i) in crossing:
                bw = self.inter_p2p_bandwidth or self.p2p_bandwidth
                lat = self.p2p_latency if self.inter_p2p_latency is None else self.inter_p2p_latency
                return lat + nbytes / bw
            return self.p2p_latency + nbytes / self.p2p_bandwidth

        params_stage = [tsum(pr, r) for r in stages]
        params_sub = [tsum(pr, r) for r in subs]
        table = CostTable(
            split=d,
            fwd=[tsum(ft, r) for r in stages],
            bwd=[bmul * tsum(ft, r) for r in subs],
            opt=[x / self.optim_params_per_s for x in params_sub],
            load_stage=[x * self.param_bytes / self.h2d_bandwidth for x in params_stage],
            load_sub=[x * self.param_bytes / self.h2d_bandwidth for x in params_sub],
            offload=[x * self.grad_bytes / self.d2h_bandwidth for x in params_sub],
            act_xfer=[xfer(Message.ACT, s, self.act_bytes) for s in range(nsf)],
            grad_xfer=[xfer(Message.GRAD, g, self.act_bytes) for g in range(nsf * d)],
            ckpt_xfer=[xfer(Message.CKPT, g, b) for g, b in enumerate(ckpt_b)],
            allreduce=self.allreduce_latency,
            param_stage=[x * self.param_bytes for x in params_stage],
            param_sub=[x * self.param_bytes for x in params_sub],
            grad_mem=[x * self.grad_bytes for x in params_sub],
            ckpt_mem=[tsum(act, r) for r in subs] if keep else ckpt_b,
            fwd_work=[max((act[i] for i in r), default=0.0) for r in stages],
            bwd_work=[tsum(act, r) + self.bwd_once_bytes for r in subs],
            host_bytes_per_param=self.host_bytes_per_param,
            param_bytes=self.param_bytes,
            params_stage=params_stage,
            params_sub=params_sub,
            rendezvous=self.rendezvous,
            posted_sends=self.posted_sends,
            optim_workers=self.optim_workers,
            unit="s",
            op_host=self.op_host,
            process_bytes=self.process_bytes,
            host_lane=self.host_lane,
            # a backward is an input and a weight gradient, half of ``bwd_ratio`` each
            head_igrad=self.bwd_ratio / 2 * ft[-1],
        )
        return table if self.replica is None else with_replicas(table, self.replica, schedule)

    def _crossing(self, schedule: Schedule) -> set[tuple[Message, int]]:
        """Messages ``(family, cost index)`` whose sender and receiver are on different nodes."""
        gpn = self.gpus_per_node
        if not gpn or gpn >= schedule.n_ranks:
            return set()
        d = schedule.partition.split
        out = set()
        for rank, ops in enumerate(schedule.ops):
            for op in ops:
                if op.kind in SENDS and rank // gpn != op.peer // gpn:
                    family = op.message[0]
                    out.add((family, op.stage if family == Message.ACT else op.stage * d + op.sub))
        return out


def with_replicas(table: CostTable, replica: ReplicaCosts, schedule: Schedule) -> CostTable:
    """``table`` with ``replica``'s replicas: optimizer times / R, every unit's reduction, and every
    rank's end-of-step exchange of the shards it owns (one exchange per step). R=1: ``table``."""
    r = replica.replicas
    if r == 1:
        return table
    d, place = table.split, schedule.assignment
    gather = [
        replica.gather_seconds(
            sum(replica.gather_bytes(table.params_sub[s * d + k]) for s, k in place.bwd_substages(x))
        )
        for x in range(schedule.n_ranks)
    ]
    lane = table.host_lane
    if lane is not None and replica.share_node:  # every replica's copy of a rank draws on the node's cores
        lane = dataclasses.replace(lane, copies=lane.copies * r)
    return dataclasses.replace(
        table,
        host_lane=lane,
        opt=[x / r for x in table.opt],
        reduce=[replica.reduce_seconds(n) for n in table.params_sub],
        gather=gather,
        replicas=r,
    )


def model_layer_params(cfg: Any) -> list[int]:
    """Parameters of each flat layer ``[Embedding, Block x L, Head]`` of a ``ModelConfig``."""
    hd = cfg.dim // cfg.n_heads
    block = cfg.dim * cfg.n_heads * hd * 2 + cfg.dim * cfg.n_kv_heads * hd * 2 + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim
    head = cfg.dim + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    return [cfg.vocab_size * cfg.dim] + [block] * cfg.n_layers + [head]


def model_layer_act_bytes(cfg: Any, tokens: int, dtype_bytes: int = 2) -> list[float]:
    """Activations each layer keeps for its backward, for ``tokens`` tokens (estimate).

    Block: inputs of the two norms and their outputs, q, k, v, attention output, the residual,
    gate, up and SwiGLU output (fused attention keeps only a log-sum-exp per head and token).
    Head: normed input plus fp32 logits and their gradient. Embedding: its output.
    """
    hd = cfg.dim // cfg.n_heads
    block = tokens * (dtype_bytes * (6 * cfg.dim + 2 * cfg.n_kv_heads * hd + 3 * cfg.ffn_dim) + 4 * cfg.n_heads)
    head = tokens * (dtype_bytes * 2 * cfg.dim + 8 * cfg.vocab_size)
    return [float(tokens * dtype_bytes * cfg.dim)] + [float(block)] * cfg.n_layers + [float(head)]


def costs_from_model(
    cfg: Any,
    seq_len: int,
    micro_batch_size: int,
    *,
    gpu_flops: float = 50e12,
    dtype_bytes: int = 2,
    **hardware: Any,
) -> Costs:
    """Physical :class:`Costs` of a ``ModelConfig``: layer time = forward FLOPs / ``gpu_flops``.

    ``gpu_flops`` is the achieved (not peak) FLOP/s of one GPU; ``hardware`` passes bandwidths,
    latencies, optimizer throughput and workers to :class:`Costs`.
    """
    from sysx.model import layer_flops  # the model contract; imported lazily

    tokens = seq_len * micro_batch_size
    flops = layer_flops(cfg, seq_len)
    # the embedding is a lookup: give it the time of reading its output once
    times = [max(f * tokens / gpu_flops, 1e-9) for f in flops]
    return Costs(
        layer_fwd_time=tuple(times),
        layer_params=tuple(float(x) for x in model_layer_params(cfg)),
        act_bytes=float(tokens * cfg.dim * dtype_bytes),
        layer_act_bytes=tuple(model_layer_act_bytes(cfg, tokens, dtype_bytes)),
        input_bytes=float(tokens * 8),
        param_bytes=float(dtype_bytes),
        grad_bytes=float(dtype_bytes),
        **hardware,
    )
