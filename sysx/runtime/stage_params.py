"""Who owns which sub-stage's parameters, and where every rank finds them (paper §4 "Offloading").

The rank that runs backward sub-stage ``(s, k)`` in the schedule's
:class:`~sysx.partition.RankAssignment` owns it: it creates the sub-stage's shared-memory segment
and holds its optimizer state. A rank that runs forward stage ``s`` attaches the segments of its
node and mirrors those owned on other nodes. :class:`StageParams` checks the node's host memory,
builds the segments, pushes to mirrors and closes them.

A unit whose step the schedule spreads (:mod:`sysx.schedule.spread`) is stepped in shards by every
rank of its owner's node: each of them keeps its shard's master (:meth:`StageParams.shard`) and
writes its slice of the one working copy, and the owner's gradients land in a node segment
(:attr:`StageParams.spread_landing`) the others read their slices from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sysx import device as dev
from sysx.dist import DistInfo, posted, wait_for
from sysx.memory import HostMemoryPlan, SharedParamStore, StageSpec
from sysx.memory.node_plan import UnitPlace, node_host_memory
from sysx.model import FlatLayout, ModelConfig, build_layers
from sysx.model.llama import LayerInit, make_layer, seed_init
from sysx.optim.decay import Ranges, no_decay_ranges, shard_ranges
from sysx.optim.grad_norm import NormSlots, grid_cuts, grid_shards
from sysx.optim.rollback_choice import choose_rollback, tier_disk_free
from sysx.optim.stage import CHUNK_ELEMS
from sysx.partition import unit_label
from sysx.replicas import ReplicaLayout
from sysx.schedule import Schedule
from sysx.schedule.spread import spread_ranks


def layer_params(model_cfg: ModelConfig) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``(name, shape)`` of each flat layer's parameters in flat-buffer order (built on the meta
    device: no memory, no initialisation)."""
    out = []
    for i in range(model_cfg.n_layers + 2):
        layer = make_layer(model_cfg, i, device="meta")
        out.append([(e.name.split(".", 1)[1], e.shape) for e in FlatLayout.from_modules([layer]).entries])
    return out


@dataclass(frozen=True)
class SubStage:
    """One backward sub-stage's parameter unit and who uses it."""

    stage: int
    sub: int
    layers: range
    numel: int
    owner: int  # global rank running its backward and optimizer (in this rank's replica)
    fwd_rank: int  # global rank running the forward of its stage (in this rank's replica)
    owner_node: int
    fwd_node: int

    @property
    def key(self) -> str:
        """``s<stage>.<sub>``."""
        return unit_label(self.stage, self.sub)

    @property
    def mirrored(self) -> bool:
        """True when the forward rank lives on another node than the owner."""
        return self.fwd_node != self.owner_node


def sub_stages(
    schedule: Schedule, numels: list[int], info: DistInfo, layout: ReplicaLayout | None = None
) -> dict[tuple[int, int], SubStage]:
    """Every sub-stage of ``schedule`` with its owner, its forward rank (global ranks of ``layout``'s
    replica; None: one replica) and their nodes."""
    part, place = schedule.partition, schedule.assignment
    base = layout.global_rank(0) if layout is not None else 0
    out = {}
    for s in range(part.n_stages):
        for k in range(part.split):
            layers = part.sub_layers(s, k)
            owner, fwd = base + place.bwd_rank[s][k], base + place.fwd_rank[s]
            out[(s, k)] = SubStage(
                s, k, layers, sum(numels[i] for i in layers), owner, fwd, info.node_of(owner), info.node_of(fwd)
            )
    return out


class StageParams:
    """This rank's view of the shared parameter store (see docs/architecture.md)."""

    def __init__(
        self,
        schedule: Schedule,
        model_cfg: ModelConfig,
        info: DistInfo,
        *,
        dtype: torch.dtype,
        job: str,
        seed: int,
        group: dist.ProcessGroup | None,
        timeout_s: float,
        pin: bool | None = None,
        init: LayerInit | None = None,
        rollback: str = "undo",
        layout: ReplicaLayout | None = None,
        tier: tuple[str, str | None] = ("host", None),
    ) -> None:
        self.info = info
        self.replica_layout: ReplicaLayout = (  # the job's replicas (one: a pipeline over every rank)
            layout if layout is not None else ReplicaLayout(1, info.world_size, info.rank, info.local_world_size)
        )
        self.model_cfg = model_cfg
        self.rank = info.rank
        self.dtype = dtype
        self.group = group
        self.timeout_s = timeout_s
        self.order = list(schedule.assignment.bwd_order)
        self.params_of_layer = layer_params(model_cfg)
        self.numels = [sum(_numel(shape) for _, shape in entries) for entries in self.params_of_layer]
        self.units = sub_stages(schedule, self.numels, info, self.replica_layout)
        base = self.replica_layout.global_rank(0)
        # units whose step a node's ranks share: their global ranks, in shard order
        self.spread = {key: [base + r for r in ranks] for key, ranks in spread_ranks(schedule).items()}
        self.spread_landing: dict[tuple[int, int], torch.Tensor] = {}  # the owner's gradients, node-wide
        self.pin = pin  # page-lock host memory the device copies from (the job's device is a GPU)
        self.store = SharedParamStore(job=job, node=info.node_rank, pin=pin, attach_timeout_s=timeout_s)
        self.masters: dict[tuple[int, int], torch.Tensor] = {}  # owned: fp32 master weights of this replica's shard
        self.shared: dict[tuple[int, int], torch.Tensor] = {}  # every unit this rank reads: its shared tensor
        self.rollback = rollback  # optim.rollback, resolved by _open (auto -> exact or undo)
        # (optim.offload, optim.nvme_dir): the node's host-memory check counts the NVMe tier's plan, and
        # rollback=auto the free space of its directory
        self.offload, self.nvme_dir = tier
        try:
            self._open(model_cfg, init or seed_init(seed))
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------------------------- set-up
    def owned(self) -> list[SubStage]:
        """Sub-stages this rank owns, in backward execution order."""
        return [self.units[key] for key in self.order if self.units[key].owner == self.rank]

    def stepped(self) -> list[SubStage]:
        """Sub-stages this rank holds optimizer state of, in backward execution order: the owned ones
        and those whose spread step it shares."""
        return [
            self.units[key]
            for key in self.order
            if self.units[key].owner == self.rank or self.rank in self.spread.get(key, ())
        ]

    def shard(self, unit: SubStage) -> range:
        """The elements of ``unit``'s flat buffer this rank's optimizer steps: its shard of a spread
        step, else its replica's shard (one replica: all)."""
        key = (unit.stage, unit.sub)
        ranks = self.spread.get(key, [])
        if self.rank in ranks:
            return self.spread_shards(key)[ranks.index(self.rank)]
        return self.replica_layout.shard(unit.numel)

    def spread_shards(self, key: tuple[int, int]) -> list[range]:
        """Every sharer's shard of spread unit ``key``, in their order: as equal as cuts on each
        layer's norm chunk grid allow (:func:`~sysx.optim.grad_norm.grid_shards`), so the gradient
        norm keeps its bits (:class:`~sysx.optim.grad_norm.NormSlots`)."""
        layers = self.units[key].layers
        return grid_shards([self.numels[i] for i in layers], len(self.spread[key]), CHUNK_ELEMS)

    def norm_slots(self) -> NormSlots:
        """The slots of the gradient norm's all-reduce: one per layer, and the tails of the layers
        the spread steps' shards cut (the same on every rank)."""
        cut = []
        for key in sorted(self.spread):
            layers = self.units[key].layers
            for i, numel, cuts in grid_cuts([self.numels[j] for j in layers], self.spread_shards(key)):
                cut.append((layers[i], numel, cuts))
        return NormSlots.cut(len(self.numels), cut, CHUNK_ELEMS)

    def no_decay(self, unit: SubStage) -> Ranges:
        """The ranges of ``unit``'s 1-D parameters (norm weights) in this rank's shard of its flat
        buffer: what its optimizer steps without weight decay (:mod:`sysx.optim.decay`)."""
        shapes = [shape for i in unit.layers for _, shape in self.params_of_layer[i]]
        cut = self.shard(unit)
        return shard_ranges(no_decay_ranges(shapes), cut.start, cut.stop)

    def _spec(self, unit: SubStage) -> StageSpec:
        mirrors = {unit.fwd_node} if unit.mirrored else set()
        return StageSpec.of(unit.key, {self.dtype: unit.numel}, owner_node=unit.owner_node, mirror_nodes=mirrors)

    def node_plan(self, rollback: str = "undo", offload: str = "host") -> HostMemoryPlan:
        """Host memory this rank's node needs (:func:`~sysx.memory.node_plan.node_host_memory`): the
        segments of the units the node's ranks own or run forward (once per node, replicas share
        them), fp32 masters (16-bit runs), Adam states, fp32 gradients and ``rollback``'s buffers of
        the shards its ranks own, and every owning rank's full-size host gradient landing buffer.
        ``self.replica_layout`` places the replicas; ``offload``: ``optim.offload`` (``nvme``: the
        state files and the staging pools instead of masters, m, v and rollback buffers)."""
        layout = self.replica_layout
        base = layout.global_rank(0)  # the units' ranks are this replica's global ranks
        units = [UnitPlace(u.numel, u.owner - base, u.fwd_rank - base) for u in self.units.values()]
        node = layout.node_of(layout.rank)
        return node_host_memory(units, layout, node, self.dtype, rollback=rollback, offload=offload)

    def _open(self, model_cfg: ModelConfig, init: LayerInit) -> None:
        self._check_budget()
        self._check_spread()
        self.barrier()
        for unit in self.stepped():
            layers = build_layers(model_cfg, unit.layers.start, unit.layers.stop, init=init)
            master = FlatLayout.from_modules(layers).flatten(layers)
            del layers
            key, cut = (unit.stage, unit.sub), self.shard(unit)
            if self._creates(unit):
                shared = self.store.create(self._spec(unit))[self.dtype]
                shared.copy_(master)
                self.shared[key] = shared
                if key in self.spread:
                    self.spread_landing[key] = self.store.create(self._landing_spec(unit))[self.dtype]
            # every replica (sharer of a spread step) builds the same initial weights (one seed) and keeps its shard's masters
            self.masters[key] = master[cut.start : cut.stop].clone() if self.dtype != torch.float32 else master
        self.barrier()
        for unit in self.stepped():
            key, cut = (unit.stage, unit.sub), self.shard(unit)
            if not self._creates(unit):  # another rank on this node made the one copy; attach after it wrote
                self.shared[key] = self.store.attach(self._spec(unit))[self.dtype]
                if key in self.spread:
                    self.spread_landing[key] = self.store.attach(self._landing_spec(unit))[self.dtype]
            if self.dtype == torch.float32:  # fp32: the shared copy is the master (this rank's shard of it)
                self.masters[key] = self.shared[key][cut.start : cut.stop]
        for unit in self.units.values():
            key = (unit.stage, unit.sub)
            if unit.fwd_rank != self.rank or key in self.shared:
                continue
            if unit.mirrored:
                self.shared[key] = self.store.create(self._spec(unit))[self.dtype]
            else:
                self.shared[key] = self.store.attach(self._spec(unit))[self.dtype]
        self.push_mirrors()
        self.barrier()

    def grad_landings(self) -> tuple[dict[tuple[int, int], torch.Tensor], dict[tuple[int, int], list[torch.Tensor]]]:
        """The ``node`` reduction's gradient landing buffers (collective over the job): each owned
        unit's own buffer, a segment the other replicas on the node read their shards from, and
        every replica's buffer of each unit in replica order (:mod:`sysx.runtime.replica_sync`)."""
        mine: dict[tuple[int, int], torch.Tensor] = {}
        node = self.info.node_rank
        for unit in self.owned():
            spec = StageSpec.of(f"g{self.replica_layout.replica}.{unit.key}", {self.dtype: unit.numel}, owner_node=node)
            mine[(unit.stage, unit.sub)] = self.store.create(spec)[self.dtype]
        self.barrier("gradient landing set-up barrier")
        every: dict[tuple[int, int], list[torch.Tensor]] = {}
        for unit in self.owned():
            key = (unit.stage, unit.sub)
            every[key] = [
                mine[key]
                if r == self.replica_layout.replica
                else self.store.attach(StageSpec.of(f"g{r}.{unit.key}", {self.dtype: unit.numel}, owner_node=node))[
                    self.dtype
                ]
                for r in range(self.replica_layout.replicas)
            ]
        return mine, every

    def _creates(self, unit: SubStage) -> bool:
        """Whether this rank creates ``unit``'s segment (it owns it, and no other replica on the node
        made the one copy); the sharers of a spread step attach the owner's."""
        return unit.owner == self.rank and self.creates_segments()

    def _landing_spec(self, unit: SubStage) -> StageSpec:
        """The node segment a spread unit's offloaded gradients land in."""
        return StageSpec.of(f"land.{unit.key}", {self.dtype: unit.numel}, owner_node=unit.owner_node)

    def _check_spread(self) -> None:
        """A spread step's sharers must map its owner's segments: one node, one replica."""
        for key, ranks in self.spread.items():
            unit = self.units[key]
            away = [r for r in ranks if self.info.node_of(r) != unit.owner_node]
            if away or self.replica_layout.replicas > 1:
                raise ValueError(
                    f"the step of {unit.key} is spread over ranks {ranks}: "
                    + (f"ranks {away} are not on its owner's node {unit.owner_node}" if away else "with replicas")
                    + "; spread it over the owner's node only (schedule.spread_last_step with one replica)"
                )

    def creates_segments(self) -> bool:
        """Whether this rank creates its owned units' segments: always, except when replicas share
        the node (``node`` reduction), where the first replica's owner makes the one copy."""
        return self.replica_layout.reduction != "node" or self.replica_layout.replica == 0

    def _check_budget(self) -> None:
        """One host-memory check per node (its first local rank), before any rank of it allocates;
        ``auto`` becomes ``exact`` only when every node's check allows it (one all-reduce)."""
        requested, why = self.rollback, ""
        mode = requested
        if self.info.local_rank == 0:
            free = tier_disk_free(self.offload, self.nvme_dir)
            mode, why = choose_rollback(requested, lambda r: self.node_plan(r, self.offload), disk_free=free)
        if requested != "auto":
            return
        fits = torch.tensor([0 if mode == "undo" else 1], dtype=torch.int32)  # other local ranks: no vote against
        if self.group is not None and self.info.world_size > 1:
            work = dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
            wait_for(
                work,
                rank=self.rank,
                what="optim.rollback=auto (host budget all-reduce)",
                peer=None,
                timeout_s=self.timeout_s,
            )
        self.rollback = "exact" if int(fits) else "undo"
        if self.rank == 0:
            if mode == "exact" and self.rollback == "undo":
                why = "optim.rollback=auto -> undo: another node's host memory cannot hold the exact rollback's buffers"
            print(why, flush=True)

    def barrier(self, what: str = "parameter store set-up barrier") -> None:
        """Every rank waits here (bounded by the timeout): what owners wrote is visible after it."""
        if self.group is not None and self.info.world_size > 1:
            work = dist.barrier(group=self.group, async_op=True)
            wait_for(work, rank=self.rank, what=what, peer=None, timeout_s=self.timeout_s)

    # ------------------------------------------------------------------------------------- use
    def pieces(self, stage: int, sub: int) -> list[torch.Tensor]:
        """Host tensors whose concatenation is the flat parameters of forward stage ``stage``
        (``sub == -1``) or of sub-stage ``(stage, sub)``."""
        subs = [k for (s, k) in self.units if s == stage] if sub < 0 else [sub]
        try:
            return [self.shared[(stage, k)] for k in sorted(subs)]
        except KeyError as err:
            raise RuntimeError(
                f"rank {self.rank}: parameters of {unit_label(stage, sub)} are not mapped on this rank "
                f"(missing {err}); the schedule loads a unit this rank neither owns nor runs forward"
            ) from None

    def push_mirrors(self) -> int:
        """Owners send their updated parameters to the mirrors on other nodes; forward ranks
        receive into theirs. Every rank calls it (after the step); returns the messages handled."""
        works: list[tuple[dist.Work, str, int]] = []
        for key in sorted(self.units):
            unit = self.units[key]
            if not unit.mirrored:
                continue
            if unit.owner == self.rank:
                works.append(
                    (
                        posted(dist.isend(self.shared[key], dst=unit.fwd_rank, group=self.group), "mirror push"),
                        f"mirror push of {unit.key} to node {unit.fwd_node}",
                        unit.fwd_rank,
                    )
                )
            elif unit.fwd_rank == self.rank:
                works.append(
                    (
                        posted(dist.irecv(self.shared[key], src=unit.owner, group=self.group), "mirror update"),
                        f"mirror update of {unit.key} from node {unit.owner_node}",
                        unit.owner,
                    )
                )
        for work, what, peer in works:
            wait_for(work, rank=self.rank, what=what, peer=peer, timeout_s=self.timeout_s)
        return len(works)

    def master_state(self, current: Mapping[tuple[int, int], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """fp32 copies of the master weights of the owned sub-stages, by parameter name
        (``layers.<i>.<name>``, as in :class:`sysx.model.LlamaModel`); ``current`` gives the
        optimizers' current masters where they moved (``optim.rollback=exact`` switches buffers) or
        where they alone hold them (the NVMe tier's 16-bit runs keep no RAM master)."""
        out = {}
        masters = {**self.masters, **current} if current is not None else self.masters
        for key, master in masters.items():
            if master.numel() != self.units[key].numel:  # a shard of a spread step: its owner answers
                continue
            offset = 0
            for i in self.units[key].layers:
                for name, shape in self.params_of_layer[i]:
                    n = _numel(shape)
                    out[f"layers.{i}.{name}"] = master[offset : offset + n].detach().clone().view(shape)
                    offset += n
        return out

    def layout(self, key: tuple[int, int]) -> FlatLayout:
        """How sub-stage ``key``'s parameters lie in its flat buffers (built on the meta device)."""
        r = self.units[key].layers
        return FlatLayout.from_modules(build_layers(self.model_cfg, r.start, r.stop, device="meta", init=_no_init))

    def close(self) -> None:
        """Drop every view of shared memory and close the store (unlink what this rank created)."""
        dev.synchronize_all()  # after an error, H2D copies from these mappings may still be in flight
        self.masters.clear()
        self.shared.clear()
        self.spread_landing.clear()
        self.store.close()


def _no_init(layer: object, index: int) -> None:
    """Meta layers hold no values to fill."""


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n
