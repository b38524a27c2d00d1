"""One backward sub-stage's share of the host optimizer.

A :class:`StageOptimizer` owns the sub-stage's fp32 master weights (through its
:class:`~sysx.optim.CpuAdam`), an fp32 gradient buffer and an optional *target* that receives the new
working copy after every change (the 16-bit view into the shared parameter store). Its operations:
:meth:`load_grads`, :meth:`apply`, :meth:`undo` and :meth:`restep`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sysx.config.choices import SPECULATE_AFTER
from sysx.optim.cpu_adam import CpuAdam
from sysx.optim.grad_norm import Pieces, slot_chunks
from sysx.optim.scratch import ScratchPool

if TYPE_CHECKING:
    from sysx.config.sections import OptimSection
    from sysx.optim.device_lane import DeviceLane
    from sysx.optim.nvme.tier import TieredState

CHUNK_ELEMS = 1 << 18
NORM_ROW = 1024  # elements a fp32 norm adds before its square joins the fp64 sum (see chunk_square)
_IN_RAM = contextlib.nullcontext()  # the residency of a state in host memory: nothing to do


@dataclass(frozen=True)
class OptimSettings:
    """Hyper-parameters and mechanics of a host optimizer (``optim.*``)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_clip: float
    backend: str = "auto"
    rollback: str = "undo"
    workers: int | None = None
    threads_per_worker: int | None = None
    speculate: str = "auto"  # auto | always | never (sysx.optim.speculate); asynchronous schedules only
    speculate_after: int = SPECULATE_AFTER
    decay_norms: bool = False  # True: weight decay on the 1-D parameters too (sysx.optim.decay)
    offload: str = "host"  # host | nvme: the fp32 states in files (sysx.optim.nvme)
    nvme_dir: str | None = None
    nvme_engine: str = "auto"

    @property
    def tier(self) -> tuple[str, str | None]:
        """``(offload, nvme_dir)``: where the fp32 states live."""
        return self.offload, self.nvme_dir

    @classmethod
    def from_config(
        cls, section: OptimSection, *, backend: str, rollback: str, workers: int | None = None
    ) -> OptimSettings:
        """The settings of ``section`` (``optim.*``) with the run's CPU Adam ``backend``, its
        resolved ``rollback`` (never ``auto``) and optimizer ``workers`` (None: the core plan's)."""
        return cls(
            lr=section.lr,
            betas=(section.betas[0], section.betas[1]),
            eps=section.eps,
            weight_decay=section.weight_decay,
            grad_clip=section.grad_clip,
            backend=backend,
            rollback=rollback,
            workers=workers,
            speculate=section.speculate,
            speculate_after=section.speculate_after,
            decay_norms=section.decay_norms,
            offload=section.offload,
            nvme_dir=section.nvme_dir,
            nvme_engine=section.nvme_engine,
        )


@dataclass
class StageReport:
    """What one stage's optimizer job did (times are ``time.perf_counter()`` seconds)."""

    stage: str
    found_inf: bool = False
    sq_norm: float = 0.0  # squared L2 norm of the unscaled fp32 gradients (inf/nan on overflow)
    pieces: tuple[tuple[int, float], ...] = ()  # sq_norm per piece of the model (sysx.optim.grad_norm)
    stepped: bool = False
    t_submit: float = 0.0  # handed to the worker
    t_ready: float = 0.0  # gradients on the host (event complete)
    t_done: float = 0.0  # step finished and target written
    thread: str = ""
    extra: dict[str, float] = field(default_factory=dict)


class StageOptimizer:
    """Master weights, Adam state, fp32 gradients and the parameter target of one sub-stage.

    ``store``: the master, m and v live in the NVMe tier (:mod:`sysx.optim.nvme`); ``master`` is
    then their initial value, written to the stage's file (and kept only when it is the fp32 working
    copy). Every operation holds the state resident while it runs (:meth:`resident`)."""

    def __init__(
        self,
        name: str,
        master: torch.Tensor,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        backend: str = "deepspeed",
        rollback: str = "undo",
        target: torch.Tensor | None = None,
        grad_buffer: torch.Tensor | None = None,
        keep_grads: bool = True,
        param_spans: Sequence[tuple[int, int]] | None = None,
        no_decay: Sequence[tuple[int, int]] = (),
        scratch: ScratchPool | None = None,
        store: TieredState | None = None,
        pieces: Pieces | None = None,
    ) -> None:
        self.name = name
        if store is not None:
            if target is None and store.spec.with_param:
                target = master  # fp32 with two slots: the working copy is the target, its master on disk
            store.fill(master)
        elif target is None and rollback == "exact":
            target, master = master, master.detach().clone()  # see docs/architecture.md
        self.optimizer = CpuAdam(
            None if store is not None else master,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            backend=backend,
            rollback=rollback,
            no_decay=no_decay,
            store=store,
        )
        n = self.optimizer.numel
        if target is not None and target.numel() != n:
            raise ValueError(f"stage {name}: target has {target.numel()} elements, the master weights {n}")
        if target is not None and target.device.type != "cpu":
            raise ValueError(
                f"stage {name}: target is on {target.device}; it must be a host tensor (shared store view)"
            )
        self.target = target.view(-1) if target is not None else None
        if grad_buffer is not None and not keep_grads:
            raise ValueError(f"stage {name}: a grad_buffer is kept by definition; keep_grads=False allocates per job")
        if grad_buffer is None and keep_grads:
            grad_buffer = torch.empty(n, dtype=torch.float32)
        if grad_buffer is not None and (
            grad_buffer.dtype != torch.float32 or grad_buffer.numel() != n or not grad_buffer.is_contiguous()
        ):
            raise ValueError(f"stage {name}: grad_buffer must be a contiguous fp32 tensor of {n} elements")
        self._buffer = grad_buffer.view(-1) if grad_buffer is not None else None
        self._scratch = scratch  # where the per-job fp32 gradients come from (None: fresh tensors)
        self.grad32: torch.Tensor | None = self._buffer  # the fp32 unscaled gradients while they exist
        self.param_spans = tuple(param_spans) if param_spans is not None else None
        self.param_norms: list[torch.Tensor] = []  # fp32 norm per span, from the last load_grads
        if pieces is not None and pieces.numel != n:
            raise ValueError(f"stage {name}: the pieces cover {pieces.numel} elements, the parameters {n}")
        self.pieces = pieces  # the model's pieces in this buffer: the norm summed per piece
        self.piece_squares: tuple[tuple[int, float], ...] = ()  # (norm slot, squared norm), from the last load_grads
        self._source: torch.Tensor | None = None  # the loaded gradients as given (to convert again)
        self._scale = 1.0
        self._coef = 1.0  # clip coefficient applied to grad32 by restep
        self.stepped = False

    @classmethod
    def from_settings(
        cls,
        name: str,
        master: torch.Tensor,
        settings: OptimSettings,
        *,
        target: torch.Tensor | None = None,
        grad_buffer: torch.Tensor | None = None,
        keep_grads: bool = True,
        param_spans: Sequence[tuple[int, int]] | None = None,
        no_decay: Sequence[tuple[int, int]] = (),
        scratch: ScratchPool | None = None,
        store: TieredState | None = None,
        pieces: Pieces | None = None,
    ) -> StageOptimizer:
        """A stage with ``settings``' hyper-parameters, backend and rollback; ``no_decay``: the ranges of
        its 1-D parameters (:func:`sysx.optim.decay.no_decay_ranges`), decayed all the same when
        ``settings.decay_norms``; the rest as for the constructor."""
        return cls(
            name,
            master,
            lr=settings.lr,
            betas=settings.betas,
            eps=settings.eps,
            weight_decay=settings.weight_decay,
            backend=settings.backend,
            rollback=settings.rollback,
            target=target,
            grad_buffer=grad_buffer,
            keep_grads=keep_grads,
            param_spans=param_spans,
            no_decay=() if settings.decay_norms else no_decay,
            scratch=scratch,
            store=store,
            pieces=pieces,
        )

    @property
    def master(self) -> torch.Tensor:
        """The flat fp32 master weights (with the NVMe tier: only while :meth:`resident`)."""
        return self.optimizer.param

    @property
    def store(self) -> TieredState | None:
        """The NVMe tier's state of this stage (None: in host memory)."""
        return self.optimizer.store

    def resident(self) -> contextlib.AbstractContextManager[object]:
        """Hold the master, m and v in host memory while inside (reentrant; a no-op when they always
        are): in the NVMe tier, read or found read ahead on entry, written back behind on leaving."""
        store = self.optimizer.store
        return _IN_RAM if store is None else store.resident()

    def master_copy(self) -> torch.Tensor:
        """The fp32 masters, as a view in host memory, or a copy made while resident (NVMe tier)."""
        if self.optimizer.store is None:
            return self.master
        with self.resident():
            return self.master.clone()

    @property
    def numel(self) -> int:
        """Number of parameters of this stage."""
        return self.optimizer.numel

    def _chunks(self) -> list[tuple[int, int, int]]:
        """``(slot, lo, hi)``: the buffer in chunks, aligned at every piece's start, each with its norm
        slot (its piece's, or a tail chunk's own: :class:`~sysx.optim.grad_norm.NormSlots`; -1: none)."""
        if self.pieces is not None:
            return list(slot_chunks(self.pieces, CHUNK_ELEMS))
        n = self.numel
        return [(-1, lo, min(n, lo + CHUNK_ELEMS)) for lo in range(0, n, CHUNK_ELEMS)]

    def load_grads(self, grads: torch.Tensor, *, scale: float = 1.0) -> tuple[bool, float]:
        """Copy ``grads`` (any float dtype, host) into the fp32 buffer divided by ``scale``.

        Returns ``(found_inf, squared_norm)`` of the unscaled fp32 gradients.
        """
        if grads.numel() != self.numel:
            raise ValueError(f"stage {self.name}: gradients have {grads.numel()} elements, the parameters {self.numel}")
        if grads.device.type != "cpu":
            raise ValueError(f"stage {self.name}: gradients are on {grads.device}; copy them to the host first")
        self._source, self._scale, self._coef = grads.reshape(-1), scale, 1.0
        if self._buffer is not None:
            self.grad32 = self._buffer
        elif self.grad32 is None:
            self.grad32 = self._temporary()
        sq = self._convert(self.grad32, take_norm=self.param_spans is None)
        if self.param_spans is not None:
            self.param_norms = [torch.linalg.vector_norm(self.grad32[lo : lo + n]) for lo, n in self.param_spans]
            sq = sum(float(norm) ** 2 for norm in self.param_norms)
        return (not math.isfinite(sq)), sq

    def _convert(self, out: torch.Tensor, *, take_norm: bool) -> float:
        """Write the loaded gradients, unscaled and clipped, into ``out`` chunk by chunk; returns their
        squared norm when ``take_norm`` (0.0 otherwise; per piece in :attr:`piece_squares`)."""
        src = self._source
        if src is None:
            raise RuntimeError(f"stage {self.name}: no gradients loaded")
        sq = 0.0
        squares: dict[int, float] = {}
        for piece, lo, hi in self._chunks():
            g = out[lo:hi]
            if src.data_ptr() != out.data_ptr():
                g.copy_(src[lo:hi])
            if self._scale != 1.0:
                g.div_(self._scale)
            if self._coef != 1.0:
                g.mul_(self._coef)
            if take_norm:
                x = chunk_square(g)
                sq += x
                squares[piece] = squares.get(piece, 0.0) + x
        if take_norm and self.pieces is not None:
            self.piece_squares = tuple(squares.items())
        return sq

    def _grads(self) -> torch.Tensor:
        """The fp32 gradients of this iteration, converted again when they were dropped."""
        if self.grad32 is None:
            self.grad32 = self._temporary()
            self._convert(self.grad32, take_norm=False)
        return self.grad32

    def _temporary(self) -> torch.Tensor:
        """Room for this job's fp32 gradients (``keep_grads=False``): lent by the scratch pool."""
        if self._scratch is not None:
            return self._scratch.take(self.numel)
        return torch.empty(self.numel, dtype=torch.float32)

    def drop_grads(self) -> None:
        """Free the fp32 gradients when they are a temporary (``keep_grads=False``)."""
        if self._buffer is None and self.grad32 is not None:
            if self._scratch is not None:
                self._scratch.give(self.grad32)
            self.grad32 = None

    def apply(self, lr: float, *, final: bool = False) -> None:
        """Step with the loaded gradients and write the target; ``final``: after the validation
        (never undone, so no rollback state is kept and ``stepped`` stays False)."""
        with self.resident():
            self.optimizer.step(self._grads(), lr=lr, final=final)
            self.stepped = not final
            self.drop_grads()
            self.write_target()

    def apply_on(self, lane: DeviceLane, lr: float) -> None:
        """Step with the loaded (clipped) gradients on the device lane and write the target; taken
        after the validation, so it is not undone (``stepped`` stays False)."""
        with self.resident():
            lane.step(self.optimizer, self._grads(), lr=lr)
            self.drop_grads()
            self.write_target()

    def undo(self) -> None:
        """Roll back the step of this iteration (if one was taken) and rewrite the target."""
        if not self.stepped:
            return
        with self.resident():
            self.optimizer.undo(self._grads())
            self.stepped = False
            self.drop_grads()
            self.write_target()

    def restep(self, coef: float, lr: float) -> None:
        """Undo, multiply the gradients by ``coef`` (clipping) and step again."""
        if not self.stepped:
            raise RuntimeError(f"stage {self.name}: restep without a step to redo")
        grads = self._grads()
        with self.resident():  # one residency for the undo and the step again
            self.optimizer.undo(grads)
            self.stepped = False
            self.scale_grads(coef)
            self.apply(lr, final=True)  # the validation decided: the clipped step stays

    def scale_grads(self, coef: float) -> None:
        """Multiply the loaded gradients by ``coef`` (clipping), also when they are made again later."""
        if coef != 1.0:
            self._grads().mul_(coef)
            self._coef *= coef

    def write_target(self) -> None:
        """Copy the masters into the target (casting to its dtype), chunk by chunk."""
        if self.target is None:
            return
        with self.resident():
            master = self.master
            for _, lo, hi in self._chunks():
                self.target[lo:hi].copy_(master[lo:hi])

    def new_iteration(self) -> None:
        """Forget the previous iteration's step (it was validated)."""
        self.stepped = False

    def close(self) -> None:
        """Release the optimizer backend and let go of the gradient and target views, so the
        buffers they view (page-locked or shared memory) can be unmapped even while something
        still holds this object (a worker pool's or a protocol's stage table)."""
        self.optimizer.close()
        self._buffer = self.grad32 = self._source = self.target = None
        self.param_norms = []


def chunk_square(g: torch.Tensor) -> float:
    """The squared L2 norm of the fp32 chunk ``g``, as a Python float: the norms of its rows of
    :data:`NORM_ROW` elements in fp32, their squares added in fp64 (within 1e-8 of the fp64 sum
    here, where one fp32 norm of the chunk is off by 5e-6; 6x faster than the fp64 norm, whose
    conversion was the largest part of a job beyond its Adam step), the rest in fp64; all in fp64
    when the fp32 squares overflow, so that finite gradients never read as overflow."""
    whole = g.numel() // NORM_ROW * NORM_ROW
    rows = torch.linalg.vector_norm(g[:whole].view(-1, NORM_ROW), dim=1)
    x = float(rows.double().square().sum())
    if whole < g.numel():
        x += float(torch.linalg.vector_norm(g[whole:], dtype=torch.float64)) ** 2
    if not math.isfinite(x):
        x = float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2
    return x


def now() -> float:
    """The clock of :class:`StageReport`."""
    return time.perf_counter()
