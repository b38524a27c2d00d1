"""SharedParamStore: the 16-bit working parameters of each sub-stage in POSIX shared memory.

The process that owns a sub-stage creates its segment at the exact size; every local process that
runs its forward attaches and maps it (one flat tensor per dtype, zero copies). On several nodes a
node also holds *mirror* segments of remote-owned stages, which the owners refresh after every step
(:meth:`SharedParamStore.push_to_mirrors`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sysx.memory import budget, cleanup, pinned
from sysx.memory.launcher_shm import sweep_launcher_leftovers
from sysx.memory.names import SegmentName, current_user, sanitize, segment_name
from sysx.memory.segment import Segment
from sysx.memory.views import LiveViewsError, canonical_dtype, dtype_itemsize, torch_dtype

OWNED, MIRROR = "owned", "mirror"


@dataclass(frozen=True)
class Section:
    """One dtype's flat run inside a segment's payload."""

    dtype: str
    byte_offset: int
    numel: int


@dataclass(frozen=True)
class StageSpec:
    """What one sub-stage needs in shared memory and where it lives.

    ``key`` names the sub-stage (``[A-Za-z0-9_.]``, e.g. ``"s3.1"``); ``sections`` are
    ``(dtype, numel)`` in payload order; ``owner_node`` is the node of the rank that owns it;
    ``mirror_nodes`` are the other nodes that keep a copy (their ranks run its forward).
    """

    key: str
    sections: tuple[tuple[str, int], ...]
    owner_node: int = 0
    mirror_nodes: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        SegmentName(user="u", job="j", node="0", what=f"p.{self.key}")  # validates the key's characters
        if not self.sections:
            raise ValueError(f"stage {self.key!r} has no sections")
        dtypes = [canonical_dtype(d) for d, _ in self.sections]
        if len(set(dtypes)) != len(dtypes):
            raise ValueError(f"stage {self.key!r}: one section per dtype, got {dtypes}")
        for dtype, numel in self.sections:
            if numel <= 0:
                raise ValueError(f"stage {self.key!r}: section {dtype} has {numel} elements; must be positive")
        if self.owner_node in self.mirror_nodes:
            raise ValueError(f"stage {self.key!r}: owner node {self.owner_node} cannot also be a mirror node")

    @classmethod
    def of(
        cls, key: str, numels: Mapping[Any, int], *, owner_node: int = 0, mirror_nodes: Iterable[int] = ()
    ) -> StageSpec:
        """Build from ``{dtype: numel}`` (torch dtypes or names)."""
        sections = tuple((canonical_dtype(d), int(n)) for d, n in numels.items())
        return cls(key, sections, int(owner_node), frozenset(int(n) for n in mirror_nodes))

    def layout(self) -> list[Section]:
        """Each dtype's byte offset in the payload (aligned to ``budget.SECTION_ALIGN``)."""
        out, offset = [], 0
        for dtype, numel in self.sections:
            offset = -(-offset // budget.SECTION_ALIGN) * budget.SECTION_ALIGN
            out.append(Section(canonical_dtype(dtype), offset, numel))
            offset += numel * dtype_itemsize(dtype)
        return out

    @property
    def data_bytes(self) -> int:
        """Payload bytes (exact: the sum of the sections plus alignment gaps)."""
        return budget.stage_data_bytes(self.sections)

    def role_on(self, node: int) -> str:
        """``owned`` on the owner's node, ``mirror`` on a mirror node; raises elsewhere."""
        if node == self.owner_node:
            return OWNED
        if node in self.mirror_nodes:
            return MIRROR
        raise ValueError(
            f"stage {self.key!r} is owned by node {self.owner_node} and mirrored on {sorted(self.mirror_nodes)}; "
            f"node {node} holds no copy of it"
        )

    def to_meta(self) -> dict[str, Any]:
        """The JSON form stored in the segment header."""
        return {
            "key": self.key,
            "sections": [list(s) for s in self.sections],
            "owner_node": self.owner_node,
            "mirror_nodes": sorted(self.mirror_nodes),
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> StageSpec:
        """Inverse of :meth:`to_meta`."""
        return cls(
            meta["key"],
            tuple((str(d), int(n)) for d, n in meta["sections"]),
            int(meta["owner_node"]),
            frozenset(int(n) for n in meta["mirror_nodes"]),
        )


@dataclass(frozen=True)
class MirrorPush:
    """One transfer the runtime performs: ``tensor`` (the owner's shared copy of one dtype section)
    into the same section of ``dst_segment`` on node ``dst_node``, where the receiving process
    writes straight into ``store.get(key)[dtype]`` (its mirror tensor, in shared memory)."""

    key: str
    dst_node: int
    dst_segment: str
    dtype: torch.dtype
    tensor: torch.Tensor


class StageBuffers:
    """One sub-stage's segment on this node and its flat tensors (one per dtype)."""

    def __init__(
        self, spec: StageSpec, role: str, segment: Segment, registration: pinned.HostRegistration | None
    ) -> None:
        self.spec = spec
        self.role = role
        self.segment = segment
        self.registration = registration
        self.tensors: dict[torch.dtype, torch.Tensor] = {
            torch_dtype(s.dtype): segment.tensor(s.dtype, s.byte_offset, s.numel) for s in spec.layout()
        }

    @property
    def key(self) -> str:
        """The sub-stage key."""
        return self.spec.key

    @property
    def created_here(self) -> bool:
        """True in the process that created (and will unlink) the segment."""
        return self.segment.is_owner

    @property
    def pinned(self) -> bool:
        """True when the mapping is page-locked for fast GPU copies."""
        return self.registration is not None

    def __getitem__(self, dtype: Any) -> torch.Tensor:
        return self.tensors[torch_dtype(dtype)]

    @property
    def flat(self) -> torch.Tensor:
        """The only tensor, for single-dtype stages."""
        if len(self.tensors) != 1:
            raise ValueError(f"stage {self.key!r} has {len(self.tensors)} dtypes; index it by dtype")
        return next(iter(self.tensors.values()))

    def unmap(self) -> None:
        """Drop this object's tensors, unpin and unmap (the segment stays open until closed).
        Raises LiveViewsError, keeping everything as it was, while other views are alive."""
        tensors, self.tensors = self.tensors, {}
        del tensors
        unpin = self.registration.unregister if self.registration is not None else None
        try:
            self.segment.buffer.close(before_unmap=unpin)
        except LiveViewsError:
            self.tensors = {
                torch_dtype(s.dtype): self.segment.tensor(s.dtype, s.byte_offset, s.numel) for s in self.spec.layout()
            }
            raise
        self.registration = None

    def close(self, timeout_s: float | None = None, *, deadline: float | None = None) -> None:
        """Unmap, then close the segment (the creator waits for attachers and unlinks).
        Raises LiveViewsError, changing nothing, while other views are alive."""
        self.unmap()
        self.segment.close(cleanup.detach_timeout_s() if timeout_s is None else timeout_s, deadline=deadline)

    def __repr__(self) -> str:
        return f"StageBuffers({self.key!r}, {self.role}, {self.segment.name.name}, {self.spec.data_bytes} bytes)"


class SharedParamStore:
    """The shared-memory segments of one job on one node, as seen by one process.

    ``job`` is the job id every rank agrees on (see :func:`sysx.memory.names.resolve_job_id`);
    ``node`` this process's node index. ``pin``: page-lock mappings for GPU copies (default: when
    CUDA is present). On construction, stale segments of this user (creator dead, nobody mapping
    them) are removed (``sweep=False`` to keep them) and a systemd RemoveIPC risk is warned about.
    """

    def __init__(
        self,
        *,
        job: str,
        node: int,
        user: str | None = None,
        pin: bool | None = None,
        attach_timeout_s: float = 60.0,
        sweep: bool = True,
    ) -> None:
        self.job = sanitize(job, max_len=40)
        self.node = int(node)
        self.user = current_user() if user is None else sanitize(user, max_len=32)
        self.pin = pin
        self.attach_timeout_s = attach_timeout_s
        self._stages: dict[str, StageBuffers] = {}
        budget.warn_remove_ipc_once()
        if sweep:
            # a killed launcher's own leftovers (MPICH's) go without a word: nothing of sysx was lost
            sweep_launcher_leftovers()
            removed = cleanup.sweep_stale(user=self.user)
            if removed:
                total = sum(info.size for info in removed)
                warnings.warn(
                    f"sysx: removed {len(removed)} stale shared-memory segment(s) ({budget.fmt_bytes(total)}) left by "
                    f"dead processes: {', '.join(info.name for info in removed)}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def name_of(self, key: str) -> SegmentName:
        """The segment name of sub-stage ``key`` on this node."""
        return segment_name(f"p.{key}", job=self.job, node=self.node, user=self.user)

    def _register(self, segment: Segment) -> pinned.HostRegistration | None:
        return pinned.register_host_memory(
            segment.buffer.address, segment.buffer.size, label=f"segment {segment.name.name}", pin=self.pin
        )

    def create(self, spec: StageSpec) -> StageBuffers:
        """Create this node's segment of ``spec`` (the owner's copy on the owner node, or the mirror
        on a mirror node); zero-filled, exact size, checked against free ``/dev/shm`` first."""
        if spec.key in self._stages:
            raise ValueError(f"stage {spec.key!r} is already open in this store")
        role = spec.role_on(self.node)
        segment = Segment.create(self.name_of(spec.key), spec.data_bytes, meta={**spec.to_meta(), "role": role})
        try:
            stage = StageBuffers(spec, role, segment, self._register(segment))
        except BaseException:
            segment.close()
            raise
        self._stages[spec.key] = stage
        return stage

    def attach(self, spec: StageSpec | str, *, timeout_s: float | None = None) -> StageBuffers:
        """Map the segment another local process created. ``spec`` may be just the key (the layout
        is read from the header); a full spec is checked against it."""
        key = spec if isinstance(spec, str) else spec.key
        if key in self._stages:
            raise ValueError(f"stage {key!r} is already open in this store")
        segment = Segment.attach(self.name_of(key), timeout_s=self.attach_timeout_s if timeout_s is None else timeout_s)
        try:
            stored = StageSpec.from_meta(segment.header.meta)
            if isinstance(spec, StageSpec) and spec != stored:
                raise ValueError(
                    f"segment {segment.name.name} holds stage {stored} but this process expects {spec}; "
                    "every rank must build the same partition"
                )
            stage = StageBuffers(stored, stored.role_on(self.node), segment, self._register(segment))
        except BaseException:
            segment.close()
            raise
        self._stages[key] = stage
        return stage

    def get(self, key: str) -> StageBuffers:
        """The open stage ``key``."""
        try:
            return self._stages[key]
        except KeyError:
            raise KeyError(f"stage {key!r} is not open in this store (open: {sorted(self._stages)})") from None

    def __contains__(self, key: object) -> bool:
        return key in self._stages

    def owned(self) -> list[StageBuffers]:
        """Open stages whose authoritative copy is on this node."""
        return [s for s in self._stages.values() if s.role == OWNED]

    def mirrors(self) -> list[StageBuffers]:
        """Open stages that mirror a remote owner's parameters."""
        return [s for s in self._stages.values() if s.role == MIRROR]

    def mirror_pushes(self, keys: Iterable[str] | None = None) -> list[MirrorPush]:
        """The transfers that bring mirrors up to date with this node's owned stages. Default: the
        owned stages this process created (it runs their optimizer)."""
        stages = [self.get(k) for k in keys] if keys is not None else [s for s in self.owned() if s.created_here]
        pushes = []
        for stage in stages:
            if stage.role != OWNED:
                raise ValueError(f"stage {stage.key!r} is a mirror on node {self.node}; only the owner node pushes")
            for dst in sorted(stage.spec.mirror_nodes):
                dst_name = segment_name(f"p.{stage.key}", job=self.job, node=dst, user=self.user).name
                for dtype, tensor in stage.tensors.items():
                    pushes.append(MirrorPush(stage.key, dst, dst_name, dtype, tensor))
        return pushes

    def push_to_mirrors(self, transport: Callable[[MirrorPush], Any], keys: Iterable[str] | None = None) -> list[Any]:
        """Call ``transport`` for each transfer of :meth:`mirror_pushes` (node by node, dtype by dtype)
        and return its results (e.g. async work handles to wait on)."""
        return [transport(push) for push in self.mirror_pushes(keys)]

    def close(self, timeout_s: float | None = None) -> None:
        """Close every stage: attached ones first (so peers closing at the same time never wait on
        each other), then created ones: all marked closing, then one shared wait for attachers
        (``timeout_s``, default ``SYSX_SHM_DETACH_TIMEOUT`` or 30 s) and unlink. Raises
        LiveViewsError naming the stages that still had live tensor views; the rest are closed."""
        failed = []
        for stage in [s for s in self._stages.values() if not s.created_here]:
            try:
                stage.close()
                del self._stages[stage.key]
            except LiveViewsError:
                failed.append(stage.key)
        releasing = []
        for stage in [s for s in self._stages.values() if s.created_here]:
            try:
                stage.unmap()
                stage.segment.mark_closing()
                releasing.append(stage)
            except LiveViewsError:
                failed.append(stage.key)
        deadline = time.monotonic() + (cleanup.detach_timeout_s() if timeout_s is None else timeout_s)
        for stage in releasing:
            stage.segment.close(deadline=deadline)
            del self._stages[stage.key]
        if failed:
            raise LiveViewsError(
                f"stages {failed} still have live tensor views (e.g. parameters bound to them); delete those, then "
                "call close() again (until then they stay registered for cleanup at exit)"
            )

    def __enter__(self) -> SharedParamStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SharedParamStore(job={self.job!r}, node={self.node}, stages={sorted(self._stages)})"
