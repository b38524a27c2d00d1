"""What ``optim.offload=nvme`` costs, as pure arithmetic: bytes on disk, bytes through the disk per
step, host bytes with and without the tier, the I/O a step cannot hide and the largest model a node
holds. The node plan, the pre-flight, ``sysx plan``/``plan-single`` and the autotuner all use it.

Per parameter (:func:`sysx.memory.budget.training_state_bytes` with ``offload="nvme"``): the files
hold one slot of fp32 (p, m, v), 12 bytes (fp32 runs: m and v, 8 bytes, their master is the working
copy in RAM); ``snapshot``/``exact`` keep two slots of (p, m, v), 24 bytes, a step reading one and
writing the other. RAM keeps the working copy, the gradients and one staging pool per rank.

The overlap model (one queue, whole step):
  Each stage's master, m and v are read once and written once per step (the expected case: no
  rollback). Reads run ahead during the forward and the earlier sub-stages' backward, writes
  behind, during the later sub-stages and the next step's forward; so in steady state the node's
  drives have the whole step to serve one step's I/O, reads and writes taking turns:
      io_s      = read_bytes / read_rate + write_bytes / write_rate
      exposed_s = max(0, io_s - step_s)       (step_s: the step without the tier)
  It assumes the staging pool is deep enough to keep the drives busy (the tier refills a buffer
  as soon as its write-back ends) and that CPU Adam is not slowed by the copies.
  The step time grows with the micro-batches while the I/O does not, so the disk hides from
  ``m* = ceil((io_s - a) / b)`` micro-batches on, where ``step_s(m) = a + b m``.
  A rolled-back step costs extra: ``undo`` reads the stepped set back and writes the restored one
  (one more read and write); ``snapshot``/``exact`` keep the previous set in its file slot, so
  nothing moves. A clipping re-step then steps again: one more read and write in every mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sysx.memory.budget import StageSizes, fmt_bytes, plan_host_memory, training_state_bytes
from sysx.memory.views import canonical_dtype, dtype_itemsize

GB = 1e9


@dataclass(frozen=True)
class DiskRates:
    """The sustained rates of a node's state-file directory, in bytes/s (measured or assumed)."""

    read_bytes_per_s: float
    write_bytes_per_s: float
    free_bytes: int | None = None  # free in the directory when read (None: not known)
    how: str = "assumed"  # "measured (aio, O_DIRECT)" and the like

    def io_seconds(self, read_bytes: float, write_bytes: float) -> float:
        """Seconds the drives are busy for ``read_bytes`` and ``write_bytes`` (one queue)."""
        return read_bytes / self.read_bytes_per_s + write_bytes / self.write_bytes_per_s

    def describe(self) -> str:
        """``read 3.2 GB/s, write 2.1 GB/s``."""
        free = "" if self.free_bytes is None else f", {fmt_bytes(self.free_bytes)} free"
        return (
            f"read {self.read_bytes_per_s / GB:.3g} GB/s, write {self.write_bytes_per_s / GB:.3g} GB/s "
            f"({self.how}){free}"
        )


@dataclass(frozen=True)
class TierBytes:
    """A node's bytes with ``optim.offload=nvme`` beside the host-memory run."""

    disk: int  # the state files
    read: int  # read per step (expected case: no rollback)
    write: int  # written per step
    host_without: int  # host memory with optim.offload=host
    host_with: int  # host memory with the tier (working copy, gradients, staging pool)
    rollback_read: int  # extra reads of a rolled-back step
    rollback_write: int  # extra writes of a rolled-back step


def tier_bytes(
    owned: Sequence[StageSizes], *, rollback: str = "undo", mirrors: Sequence[StageSizes] = (), workers: int = 1
) -> TierBytes:
    """:class:`TierBytes` of one rank owning the stages ``owned`` (``(numel, dtype)`` or ``{dtype: numel}``,
    as :func:`~sysx.memory.budget.plan_host_memory` takes them) under ``optim.rollback=rollback``,
    with ``workers`` optimizer workers (the size of its staging and gradient pools)."""
    host = plan_host_memory(owned, mirrors=mirrors, rollback=rollback)
    tier = plan_host_memory(owned, mirrors=mirrors, rollback=rollback, offload="nvme", workers=workers)
    again = tier.step_io if rollback in ("undo", "auto") else 0
    return TierBytes(tier.disk, tier.step_io, tier.step_io, host.total, tier.total, again, again)


@dataclass(frozen=True)
class StepIo:
    """One step's disk time beside the step it hides behind (the module's overlap model)."""

    read_s: float
    write_s: float
    step_s: float  # the step without the tier
    replayed_exposed_s: float | None = None  # the disk lane's replay of the step (sysx.schedule.disk), when planned

    @property
    def io_s(self) -> float:
        """Seconds the drives are busy per step."""
        return self.read_s + self.write_s

    @property
    def exposed_s(self) -> float:
        """The I/O the step cannot hide: what it adds to the step (the replay's figure where there is
        one: the whole-step model is its lower bound, blind to the staging pool's read-ahead depth)."""
        if self.replayed_exposed_s is not None:
            return self.replayed_exposed_s
        return max(0.0, self.io_s - self.step_s)

    @property
    def hidden(self) -> bool:
        """True when the disk hides behind the step."""
        return self.exposed_s == 0.0

    def describe(self) -> str:
        """``disk 1.20 s per step (read 0.60, write 0.60) beside a 2.00 s step: exposed 0 s (hidden)``."""
        state = "hidden" if self.hidden else f"{100 * self.exposed_s / self.step_s:.0f}% of the step"
        return (
            f"disk {self.io_s:.3g} s per step (read {self.read_s:.3g}, write {self.write_s:.3g}) beside a "
            f"{self.step_s:.3g} s step: exposed {self.exposed_s:.3g} s ({state})"
        )


def step_io(read_bytes: float, write_bytes: float, rates: DiskRates, step_s: float) -> StepIo:
    """The overlap model for one node: ``read_bytes``/``write_bytes`` per step through ``rates``
    beside a step of ``step_s`` seconds."""
    return StepIo(read_bytes / rates.read_bytes_per_s, write_bytes / rates.write_bytes_per_s, step_s)


def micro_batches_to_hide(io_s: float, at: tuple[int, float], at_more: tuple[int, float]) -> int | None:
    """The fewest micro-batches per step at which a step of the line through ``at`` and ``at_more``
    (``(micro-batches, step seconds)``) lasts ``io_s`` or longer; None when the step does not grow."""
    (m1, t1), (m2, t2) = at, at_more
    if m2 == m1 or t2 <= t1:
        return None
    slope = (t2 - t1) / (m2 - m1)
    fixed = t1 - slope * m1
    return max(1, math.ceil((io_s - fixed) / slope - 1e-9))


def state_bytes_per_param(dtype: Any, rollback: str = "undo", *, window: bool = False) -> tuple[int, int, int]:
    """``(host without the tier, host with it, disk with it)`` bytes per parameter: the pipeline's
    (fp32 gradients and the 16-bit landing buffer of 16-bit runs) or with ``window`` the sliding
    window's (gradients in the working precision); staging pools left out."""
    grads = dtype if window else "float32"
    landing = 0 if window or canonical_dtype(dtype) == "float32" else dtype_itemsize(dtype)
    host = training_state_bytes(dtype, grad_dtype=grads, rollback=rollback)
    tier = training_state_bytes(dtype, grad_dtype=grads, rollback=rollback, offload="nvme")
    return host.total + landing, tier.total + landing, tier.disk


@dataclass(frozen=True)
class Fit:
    """The largest model a node holds: parameters and which resource binds."""

    params: int
    limit: str  # "host memory" or "disk"

    def describe(self) -> str:
        """``12.3B parameters (host memory)``."""
        return f"{self.params / 1e9:.1f}B parameters (bound by {self.limit})"


def largest_model(
    host_bytes: float,
    disk_bytes: float | None,
    dtype: Any,
    rollback: str = "undo",
    *,
    reserved: float = 0.0,
    staging_per_param: float = 0.0,
    window: bool = False,
) -> tuple[Fit, Fit | None]:
    """The most parameters a node with ``host_bytes`` of memory (``reserved`` of it already taken)
    and ``disk_bytes`` free under ``optim.nvme_dir`` trains, without and with the tier (None: no
    disk given). ``staging_per_param``: the staging pools per parameter of the model (a layout of
    ``n`` equal units on ``r`` ranks of the node pins about ``r * buffers * 12 / n`` bytes each);
    ``window``: the sliding window's state (:func:`state_bytes_per_param`)."""
    without, with_tier, disk = state_bytes_per_param(dtype, rollback, window=window)
    room = max(0.0, host_bytes - reserved)
    plain = Fit(int(room // without), "host memory")
    if disk_bytes is None:
        return plain, None
    by_host, by_disk = int(room // (with_tier + staging_per_param)), int(disk_bytes // disk)
    return plain, Fit(by_host, "host memory") if by_host <= by_disk else Fit(by_disk, "disk")


def disk_shortage(need: int, free: int, directory: str) -> str | None:
    """The one-line refusal when ``need`` bytes of state files do not fit the ``free`` bytes of
    ``directory``; None when they fit."""
    if need <= free:
        return None
    return (
        f"optim.nvme_dir={directory} has {fmt_bytes(free)} free but the optimizer state files need "
        f"{fmt_bytes(need)} ({need} bytes); free space there, point optim.nvme_dir at a larger drive, "
        "use more nodes, or set optim.rollback=undo (snapshot and exact keep a second set on disk)"
    )
