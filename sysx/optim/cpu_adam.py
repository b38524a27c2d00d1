"""``CpuAdam``: AdamW over one flat contiguous fp32 buffer, with a one-step rollback.

>>> opt = CpuAdam(flat_params, lr=1e-3, weight_decay=0.1, backend="torch")
>>> opt.step(flat_grads)            # p, m, v updated in place
>>> opt.undo(flat_grads)            # back to the state before that step

Backends ``deepspeed``, ``torch`` or ``auto``; rollback ``undo``, ``snapshot`` or ``exact``. With
``exact``, read the parameters and moments through the optimizer and call :meth:`CpuAdam.resume_at`
after writing them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sysx.config.choices import OPTIM_BACKENDS, ROLLBACK_MODES
from sysx.optim.decay import Ranges, check_ranges, decay_runs
from sysx.optim.exact import ExactState
from sysx.optim.formula import BetaPowers, Hyper, StepConstants, constants
from sysx.optim.undo import Snapshot, UndoWorkspace, undo_chunk

if TYPE_CHECKING:
    from sysx.optim.nvme.tier import TieredState

log = logging.getLogger("sysx.optim")


class Backend(Protocol):
    """What :class:`CpuAdam` needs from a backend."""

    name: str
    chunk_elems: int

    @property
    def simd(self) -> str: ...

    def step_chunk(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        c: StepConstants,
        scratch: torch.Tensor,
    ) -> None: ...

    def direction_chunk(self, m: torch.Tensor, v: torch.Tensor, c: StepConstants, out: torch.Tensor) -> None: ...

    def resume_at(self, step: int) -> None: ...

    def close(self) -> None: ...


_logged: set[str] = set()
_logged_lock = threading.Lock()


def _log_backend_once(backend: Backend) -> None:
    with _logged_lock:
        if backend.name in _logged:
            return
        _logged.add(backend.name)
    log.info("CpuAdam backend: %s, SIMD %s", backend.name, backend.simd)


def make_backend(name: str, hyper: Hyper) -> Backend:
    """Create the named backend; ``auto`` falls back from DeepSpeed to torch with a warning."""
    if name not in OPTIM_BACKENDS:
        raise ValueError(f"CpuAdam: backend={name!r} is not one of {list(OPTIM_BACKENDS)}")
    if name == "torch":
        from sysx.optim.torch_backend import TorchBackend

        return TorchBackend(hyper)
    from sysx.optim.deepspeed_backend import DeepSpeedBackend, DeepSpeedUnavailable

    if name == "deepspeed":
        return DeepSpeedBackend(hyper)
    try:
        return DeepSpeedBackend(hyper)
    except DeepSpeedUnavailable as exc:
        message = f"optim.backend=auto: DeepSpeed's cpu_adam is unavailable, FALLING BACK to the torch backend: {exc}"
        log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        from sysx.optim.torch_backend import TorchBackend

        return TorchBackend(hyper)


def _check_flat(t: torch.Tensor, what: str, numel: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"CpuAdam: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"CpuAdam: {what} has dtype {t.dtype}; it must be torch.float32 (convert it first)")
    if t.device.type != "cpu":
        raise ValueError(f"CpuAdam: {what} is on {t.device}; the CPU optimizer needs host tensors")
    if not t.is_contiguous():
        raise ValueError(
            f"CpuAdam: {what} is not contiguous (stride {t.stride()}); pass a contiguous buffer, e.g. t.contiguous()"
        )
    if numel is not None and t.numel() != numel:
        raise ValueError(f"CpuAdam: {what} has {t.numel()} elements but the parameters have {numel}")


class CpuAdam:
    """AdamW (DeepSpeed's formula) over one flat contiguous fp32 host tensor, updated in place.

    ``no_decay``: sorted, disjoint ``(start, stop)`` element ranges stepped without weight decay
    (the 1-D parameters, :mod:`sysx.optim.decay`); every other element is decayed.

    ``store``: the state lives in the NVMe tier (:class:`~sysx.optim.nvme.tier.TieredState`, filled
    by its owner; ``param`` is then None); read it only while the store holds it resident. With
    rollback snapshot or exact the store's two file slots are the two sets (no host copy)."""

    def __init__(
        self,
        param: torch.Tensor | None,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        backend: str = "deepspeed",
        rollback: str = "undo",
        no_decay: Sequence[tuple[int, int]] = (),
        store: TieredState | None = None,
    ) -> None:
        if store is None:
            assert param is not None, "CpuAdam: param is None without a store"
            _check_flat(param, "param")
        self._numel = param.numel() if store is None else store.numel  # type: ignore[union-attr]
        self.no_decay: Ranges = check_ranges(no_decay, self._numel)
        if rollback not in ROLLBACK_MODES:
            raise ValueError(
                f"CpuAdam: rollback={rollback!r} is not one of {list(ROLLBACK_MODES)} (resolve "
                "optim.rollback=auto first, e.g. with sysx.optim.rollback_choice.choose_rollback)"
            )
        if not lr >= 0:
            raise ValueError(f"CpuAdam: lr={lr} must be >= 0")
        self.hyper = Hyper(
            beta1=float(betas[0]), beta2=float(betas[1]), eps=float(eps), weight_decay=float(weight_decay)
        )
        self.hyper.check()
        self.lr = float(lr)
        self.step_count = 0
        self.rollback = rollback
        self._backend: Backend = make_backend(backend, self.hyper)
        # an optimizer collected without close() releases its backend too (DeepSpeed's C++ optimizer)
        self._forgotten = weakref.finalize(self, _close_quietly, self._backend)
        _log_backend_once(self._backend)
        self._exact: ExactState | TieredState | None = None  # two sets: in RAM, or two file slots
        self._store = store  # the NVMe tier's state (one or two slots)
        if store is not None:
            self._exact = store if store.slots == 2 else None
        elif rollback == "exact":
            self._exact = ExactState(param.view(-1))  # type: ignore[union-attr]
        else:
            self._param = param.view(-1)  # type: ignore[union-attr]
            self._m = torch.zeros_like(self._param)
            self._v = torch.zeros_like(self._param)
        self._powers = BetaPowers(self.hyper.beta1, self.hyper.beta2)
        self._snapshot = Snapshot(self.numel) if rollback == "snapshot" and store is None else None
        self._scratch = torch.empty(min(self._backend.chunk_elems, max(1, self.numel)), dtype=torch.float32)
        # the backend's chunks cut at the no-decay edges, once: a step walks them, each with its own decay
        self._runs = decay_runs(
            self.numel, self._backend.chunk_elems, self.no_decay if self.hyper.weight_decay > 0 else ()
        )
        self._stamp = 0  # counts step calls (any kind): tells a refresh whether a newer step came first
        self._undo_ws: UndoWorkspace | None = None  # allocated on the first undo
        self._last: tuple[StepConstants, float] | None = None  # constants of the last step, lr before it

    # ------------------------------------------------------------------------------------ info
    @property
    def param(self) -> torch.Tensor:
        """The flat fp32 parameters (with ``rollback=exact``: those of the current set)."""
        return self._state()[0] if self._store is not None or self._exact is not None else self._param

    @property
    def exp_avg(self) -> torch.Tensor:
        """Adam's first moment ``m`` (current set)."""
        return self._state()[1] if self._store is not None or self._exact is not None else self._m

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        """Adam's second moment ``v`` (current set)."""
        return self._state()[2] if self._store is not None or self._exact is not None else self._v

    def _state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        holder = self._store if self._store is not None else self._exact
        assert holder is not None
        return holder.state

    @property
    def store(self) -> TieredState | None:
        """The NVMe tier's state of this optimizer (None: in host memory)."""
        return self._store

    @property
    def backend(self) -> str:
        """Whose arithmetic steps (``deepspeed`` or ``torch``), whatever the rollback mode."""
        return self._backend.name

    @property
    def inline_refreshes(self) -> int:
        """``rollback=exact``: spare refreshes a step made itself because none ran after the
        decision (each on the step's critical path); 0 in the other modes."""
        return self._exact.inline_copies if self._exact is not None else 0

    @property
    def step_stamp(self) -> int:
        """How many times :meth:`step` or :meth:`take_step` ran (never decreases; for :meth:`refresh`)."""
        return self._stamp

    @property
    def numel(self) -> int:
        """Number of parameters."""
        return self._numel

    @property
    def can_undo(self) -> bool:
        """True when the last call was a step that has not been undone yet."""
        return self._last is not None

    @property
    def rollback_bytes(self) -> int:
        """Host memory the rollback mode costs (0 for ``undo``)."""
        if self._exact is not None:
            return self._exact.spare_bytes
        return self._snapshot.nbytes if self._snapshot is not None else 0

    def _chunks(self) -> list[tuple[int, int]]:
        n, size = self.numel, self._backend.chunk_elems
        return [(lo, min(n, lo + size)) for lo in range(0, n, size)]

    # ----------------------------------------------------------------------------------- steps
    def step(self, grad: torch.Tensor, *, lr: float | None = None, final: bool = False) -> None:
        """One AdamW step with ``grad`` (flat contiguous fp32, same size); ``lr`` sets the rate.
        ``final``: the step is already validated and will not be undone (no rollback state kept)."""
        _check_flat(grad, "grad", self.numel)
        if lr is not None:
            if not lr >= 0:
                raise ValueError(f"CpuAdam.step: lr={lr} must be >= 0")
            lr_before, self.lr = self.lr, float(lr)
        else:
            lr_before = self.lr
        c = constants(self.step_count + 1, self.lr, self.hyper, self._powers)
        plain = c.undecayed()
        g = grad.view(-1)
        save = self._snapshot if not final else None

        def in_place(state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
            p, m, v = state
            for lo, hi, decays in self._runs:
                if save is not None:
                    save.save(lo, hi, p[lo:hi], m[lo:hi], v[lo:hi])
                run_c = c if decays else plain
                self._backend.step_chunk(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], run_c, self._scratch[: hi - lo])

        exact = self._exact
        if exact is None:
            in_place((self.param, self.exp_avg, self.exp_avg_sq))
            self.state_written()  # the tier writes the changed state back
            self._count(c, lr_before, final)
            return
        with exact.lock:  # a refresh sees the step and its count together, never one without the other
            if final:
                exact.step_current(in_place)
            else:
                exact.step_spare(in_place)  # the backend's own in-place op, on the spare set
            self._count(c, lr_before, final)

    def _count(self, c: StepConstants, lr_before: float, final: bool) -> None:
        self.step_count += 1
        self._stamp += 1
        self._last = None if final else (c, lr_before)

    def take_step(self, lr: float) -> StepConstants:
        """Count a step at ``lr`` that is computed elsewhere (:mod:`sysx.optim.device_lane`) and
        return its constants (the ones :meth:`step` would use); such a step cannot be undone."""
        if not lr >= 0:
            raise ValueError(f"CpuAdam.take_step: lr={lr} must be >= 0")
        self.lr = float(lr)
        c = constants(self.step_count + 1, self.lr, self.hyper, self._powers)
        self.step_count += 1
        self._stamp += 1
        self._last = None
        return c

    def state_written(self) -> None:
        """The current ``(p, m, v)`` were written from outside (the device lane's step, a restore):
        with ``rollback=exact`` the spare no longer matches them. Call it after the writes."""
        if self._exact is not None:
            self._exact.mark_stale()
        elif self._store is not None:
            self._store.mark_stale()

    def refresh(self, stamp: int | None = None) -> bool:
        """``rollback=exact``: copy the current set into the spare, off the critical path, once the
        validation has decided (:mod:`sysx.optim.exact`). ``stamp``: :attr:`step_stamp` when the
        decision was taken; if no step came since, the last step is kept for good (it can no longer
        be undone). Does nothing while a newer step can still be undone, or when the spare is fresh,
        or in the other modes. True when it copied."""
        if self._exact is None:
            return False

        def allowed() -> bool:
            if stamp is not None and stamp == self._stamp:
                self._last = None  # the decision kept this step
            return self._last is None

        return self._exact.refresh(allowed)

    def undo(self, grad: torch.Tensor | None = None) -> None:
        """Roll back the last :meth:`step`; ``grad`` must be the gradients that step used
        (``undo`` mode; ``snapshot`` and ``exact`` ignore it). Restores step count and learning rate."""
        if self._last is None:
            raise RuntimeError("CpuAdam.undo: there is no step to undo (only the last step can be undone, once)")
        c, lr_before = self._last
        p, m, v = self.param, self.exp_avg, self.exp_avg_sq
        if self._exact is not None:
            with self._exact.lock:
                self._exact.switch_back()  # the spare (the undone step's values) is stale now
                self._last = None
        elif self._snapshot is not None:
            for lo, hi in self._chunks():
                self._snapshot.restore(lo, hi, p[lo:hi], m[lo:hi], v[lo:hi])
        else:
            if grad is None:
                raise ValueError("CpuAdam.undo: rollback='undo' needs the gradients of the step being undone")
            _check_flat(grad, "grad", self.numel)
            g = grad.view(-1)
            if self._undo_ws is None:
                self._undo_ws = UndoWorkspace()
            plain = c.undecayed()
            for lo, hi, decays in self._runs:
                run_c = c if decays else plain
                undo_chunk(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], run_c, self._backend.direction_chunk, self._undo_ws)
            self.state_written()
        self.step_count = c.step - 1
        self.lr = lr_before
        self._last = None

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Moments, step count, learning rate and hyper-parameters (the parameters are the caller's)."""
        return {
            "step": self.step_count,
            "lr": self.lr,
            "betas": (self.hyper.beta1, self.hyper.beta2),
            "eps": self.hyper.eps,
            "weight_decay": self.hyper.weight_decay,
            "exp_avg": self.exp_avg.clone(),
            "exp_avg_sq": self.exp_avg_sq.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (sizes and hyper-parameters must match)."""
        for key in ("exp_avg", "exp_avg_sq"):
            _check_flat(state[key].contiguous(), f"state_dict[{key!r}]", self.numel)
        saved = Hyper(
            float(state["betas"][0]), float(state["betas"][1]), float(state["eps"]), float(state["weight_decay"])
        )
        if saved != self.hyper:
            raise ValueError(
                f"CpuAdam.load_state_dict: saved hyper-parameters {saved} differ from this optimizer's {self.hyper}"
            )
        self.exp_avg.copy_(state["exp_avg"].view(-1))
        self.exp_avg_sq.copy_(state["exp_avg_sq"].view(-1))
        self.resume_at(int(state["step"]))
        self.lr = float(state["lr"])

    def resume_at(self, step: int) -> None:
        """Continue as if ``step`` steps had been taken here: the bias corrections are running
        products (``b1^t`` multiplied step by step, in the backend too), which a fresh optimizer
        would compute with ``pow`` and round differently; replaying them keeps a resumed run
        bit-identical to an uninterrupted one."""
        if step < 0:
            raise ValueError(f"CpuAdam.resume_at: step={step} must be >= 0")
        self._powers = BetaPowers(self.hyper.beta1, self.hyper.beta2)
        for t in range(1, step + 1):
            self._powers.at(t)
        self._backend.resume_at(step)
        self.state_written()  # the caller may have written the current set (a checkpoint restore)
        self.step_count = step
        self._stamp += 1
        self._last = None

    def close(self) -> None:
        """Release the backend (DeepSpeed's C++ optimizer); the tensors stay usable."""
        self._forgotten.detach()
        self._backend.close()

    def __enter__(self) -> CpuAdam:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        h = self.hyper
        return (
            f"CpuAdam(numel={self.numel}, backend={self.backend}, rollback={self.rollback}, lr={self.lr:g}, "
            f"betas=({h.beta1}, {h.beta2}), eps={h.eps:g}, weight_decay={h.weight_decay:g}, "
            f"no_decay={len(self.no_decay)} ranges, step={self.step_count})"
        )


def _close_quietly(backend: Backend) -> None:
    """Release a forgotten optimizer's backend (at exit the op module may be gone already)."""
    with contextlib.suppress(Exception):
        backend.close()
