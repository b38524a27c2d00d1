"""What ``sysx plan`` says about R data-parallel replicas of the planned P-rank pipeline: the step
time and throughput of the whole job, how much of the step the gradient reductions and the shard
exchange leave exposed, and the host memory of a node beside one pipeline's (pure data).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sysx.memory.budget import HostMemoryPlan, fmt_bytes
from sysx.memory.node_plan import node_host_memory, optimizer_bytes
from sysx.replicas import ReplicaLayout
from sysx.schedule.costs import CostTable
from sysx.schedule.ops import Schedule
from sysx.schedule.replica_costs import schedule_units
from sysx.schedule.simulate import Timeline, simulate


@dataclass(frozen=True)
class ReplicaPlan:
    """The plan of ``replicas`` x ``pipeline`` ranks (times in the plan's seconds)."""

    replicas: int
    pipeline: int
    share_node: bool  # every pipeline rank's peers on one node (reduce through shared memory)
    iteration: float
    tokens_per_step: int
    reduce_busy: float  # the busiest rank's reductions per step
    reduce_exposed: float  # step time the reductions add
    gather_exposed: float  # step time the end-of-step shard exchange adds
    node: HostMemoryPlan | None  # host memory of node 0 (None: unit costs, no model)
    node_one: HostMemoryPlan | None  # the same P-rank pipeline alone (R=1) on its nodes

    @property
    def tokens_per_s(self) -> float:
        """Tokens per modelled second of the whole job."""
        return self.tokens_per_step / self.iteration if self.iteration > 0 else 0.0

    @property
    def optimizer_ratio(self) -> float | None:
        """Node 0's host optimizer memory at R over R=1's (None without a model)."""
        if self.node is None or self.node_one is None or not optimizer_bytes(self.node_one):
            return None
        return optimizer_bytes(self.node) / optimizer_bytes(self.node_one)

    def summary(self) -> dict:
        """JSON-ready figures."""
        out: dict[str, Any] = {
            "replicas": self.replicas,
            "pipeline_ranks": self.pipeline,
            "peers_share_node": self.share_node,
            "iteration_s": self.iteration,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_s,
            "reduce_busy_s": self.reduce_busy,
            "reduce_exposed_s": self.reduce_exposed,
            "gather_exposed_s": self.gather_exposed,
        }
        if self.node is not None and self.node_one is not None:
            out.update(
                node_host_bytes=self.node.total,
                node_optimizer_bytes=optimizer_bytes(self.node),
                node_optimizer_bytes_one_replica=optimizer_bytes(self.node_one),
                optimizer_ratio=self.optimizer_ratio,
            )
        return out

    def describe(self) -> list[str]:
        """Lines for the plan's report."""
        how = (
            "one replica: nothing reduced or exchanged"
            if self.replicas == 1
            else "peers on one node: gradients reduced in its shared memory, no exchange"
            if self.share_node
            else "peers on other nodes: reduce-scatter and shard exchange over the inter-node link"
        )
        lines = [
            f"replicas: {self.replicas} x {self.pipeline}-rank pipeline ({self.replicas * self.pipeline} ranks; {how})",
            f"  step {self.iteration:.4g} s, {self.tokens_per_step} tokens per step, "
            f"{self.tokens_per_s:.5g} tokens per modelled second",
            f"  gradient reduction: busiest rank {self.reduce_busy:.4g} s per step, exposed {self.reduce_exposed:.4g} s; "
            f"shard exchange after the validation: exposed {self.gather_exposed:.4g} s",
        ]
        if self.node is not None and self.node_one is not None:
            lines.append(
                f"  host memory of node 0: {fmt_bytes(self.node.total)} (shared working copy "
                f"{fmt_bytes(self.node.shared)}); optimizer state {fmt_bytes(optimizer_bytes(self.node))} vs "
                f"{fmt_bytes(optimizer_bytes(self.node_one))} for one pipeline (R=1): {self.optimizer_ratio:.2f}x"
            )
        return lines


def replica_plan(
    schedule: Schedule,
    table: CostTable,
    timeline: Timeline,
    *,
    gpus_per_node: int | None,
    tokens_per_micro: int,
    layer_numels: Sequence[float] | None = None,
    dtype: str = "bfloat16",
) -> ReplicaPlan:
    """The replicas of ``table`` (:class:`~sysx.schedule.costs.CostTable` ``replicas``) running
    ``schedule``, whose plan is ``timeline``; ``gpus_per_node``: ranks per node (None: all on one);
    ``layer_numels``: parameters per flat layer (the host memory; None: not planned)."""
    r, p = table.replicas, schedule.n_ranks
    gpn = gpus_per_node or r * p
    layout = ReplicaLayout(r, p, 0, local_world_size=gpn)

    def iteration(reduce: list[float]) -> float:
        changed = dataclasses.replace(table, gather=[], reduce=reduce)
        return simulate(schedule, changed, record=False, memory=False).iteration

    no_gather = iteration(table.reduce) if table.gather else timeline.iteration
    bare = iteration([]) if table.reduce else no_gather
    d, place = table.split, schedule.assignment
    busy = (
        0.0
        if not table.reduce
        else max(sum(table.reduce[s * d + k] for s, k in place.bwd_substages(x)) for x in range(p))
    )
    node = node_one = None
    if layer_numels is not None:
        units = schedule_units(schedule, layer_numels)
        node = node_host_memory(units, layout, 0, dtype)
        node_one = node_host_memory(units, ReplicaLayout(1, p, 0, local_world_size=gpn), 0, dtype)
    return ReplicaPlan(
        r,
        p,
        layout.peers_share_node(),
        timeline.iteration,
        r * schedule.n_micro * tokens_per_micro,
        busy,
        no_gather - bare,
        timeline.iteration - no_gather,
        node,
        node_one,
    )
