"""The DeepSpeed backend of :class:`sysx.optim.CpuAdam`: DeepSpeed's ``cpu_adam`` C++ op.

:func:`load_op` builds the op on first use (about a minute), caches it per virtual environment and
self-tests it; any failure raises :class:`DeepSpeedUnavailable` with the cause and the fix. Steps
are issued in chunks of :data:`CHUNK_ELEMS`. Build ahead of time (CI, a cluster's login node) with
``python -m sysx.optim.deepspeed_backend``.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from sysx.optim.formula import BetaPowers, Hyper, StepConstants, constants, elements_off, reference_step

log = logging.getLogger("sysx.optim")

CHUNK_ELEMS = 1 << 20  # a multiple of every SIMD tile (16 lanes x span 8): chunking never changes results
STALE_LOCK_S = 900.0
_ID_BASE = 1_000_000  # DeepSpeedCPUAdam numbers its optimizers from 0 in the same C++ table
_LANES = {"AVX512": 16, "AVX256": 8, "NEON": 4, "SVE": 0, "SCALAR": 1}


class DeepSpeedUnavailable(RuntimeError):
    """DeepSpeed's cpu_adam op could not be imported, built, loaded or failed its self-test."""


def extensions_dir() -> Path:
    """Where the compiled op is cached (see docs/architecture.md for the order of choices)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    prefix = Path(sys.prefix)
    if sys.prefix != sys.base_prefix and os.access(prefix, os.W_OK):
        return prefix / "var" / "sysx" / "torch_extensions"
    import platformdirs

    key = hashlib.sha1(str(prefix.resolve()).encode()).hexdigest()[:12]
    tag = f"{key}-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.split('+')[0]}"
    return Path(platformdirs.user_cache_dir("sysx")) / "torch_extensions" / tag


def simd_flag() -> str | None:
    """DeepSpeed's SIMD define for this CPU from ``/proc/cpuinfo``; None when it cannot tell."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    words: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            words.update(value.split())
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        if "avx512f" in words:
            return "-D__AVX512__"
        if "avx2" in words:
            return "-D__AVX256__"
        return "-D__SCALAR__"
    if machine in ("aarch64", "arm64"):
        return "-D__SVE__" if "sve" in words else "-D__NEON__"
    return None


def quiet_cpu_accelerator() -> None:
    """Set ``DS_ACCELERATOR=cpu`` (when unset) only where CUDA is absent: DeepSpeed chooses its
    accelerator once per process, so on a GPU machine this would give every later DeepSpeed use in
    the process (the ZeRO-3 rows of ``bench_single.py``) the CPU accelerator."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _builder() -> Any:
    """DeepSpeed's CPU ``CPUAdamBuilder`` with the cheap CPU-feature probe of :func:`simd_flag`."""
    quiet_cpu_accelerator()
    try:
        from deepspeed.ops.op_builder.cpu import CPUAdamBuilder
    except Exception as exc:  # ImportError, or DeepSpeed failing its own import-time checks
        raise DeepSpeedUnavailable(
            f"cannot import DeepSpeed's CPUAdamBuilder ({type(exc).__name__}: {exc}); install deepspeed "
            "(see constraints.txt) or set optim.backend=torch"
        ) from exc

    class _Builder(CPUAdamBuilder):
        def cxx_args(self) -> list[str]:
            # without -g: GCC's code is the same, the build ~25% shorter and the objects 0.5 MiB instead of 18
            return [arg for arg in super().cxx_args() if arg != "-g"]

        def simd_width(self) -> str:
            return simd_flag() or super().simd_width()

        def cpu_arch(self) -> str:
            machine = platform.machine().lower()
            if machine.startswith("ppc"):
                return "-mcpu=native"
            if machine.startswith("riscv64"):
                return "-march=rv64gc"
            if machine in ("x86_64", "amd64", "aarch64", "arm64"):
                return "-march=native"
            return super().cpu_arch()

    return _Builder()


@contextlib.contextmanager
def environment_ninja() -> Iterator[str | None]:
    """While torch builds, put the ``ninja`` installed beside DeepSpeed (the ``ninja`` package, pinned in
    constraints.txt) first on ``PATH``; yields its folder, None when that package is absent (PATH decides).

    torch runs whichever ``ninja`` PATH finds first, and two ninja versions (this machine's system 1.11
    and the venv's 1.13) hash the same compile command differently: each takes the other's build for
    a changed command and rebuilds (~1 min). Without this, a process started with the venv's ``bin``
    on PATH (an activated venv, a launch script) after one started without it rebuilt the op.
    """
    try:
        import ninja

        bin_dir: str | None = ninja.BIN_DIR
    except (ImportError, AttributeError):
        bin_dir = None
    if bin_dir is None or not os.access(os.path.join(bin_dir, "ninja"), os.X_OK):
        yield None
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = bin_dir if before is None else bin_dir + os.pathsep + before
    try:
        yield bin_dir
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def clear_stale_lock(build_dir: Path) -> None:
    """Remove the build lock a killed build left in ``build_dir`` (torch waits on it forever)."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning(
            "removing %s: a build lock %.0f s old (a killed build left it; torch would wait forever)", lock, age
        )
        lock.unlink(missing_ok=True)


_op: ModuleType | None = None
_op_info: dict[str, Any] = {}
_op_lock = threading.Lock()


def load_op() -> ModuleType:
    """Build (first use in this venv) or load the cached cpu_adam op, self-test it, log it.

    Thread-safe and done once per process. Raises :class:`DeepSpeedUnavailable` on any failure.
    """
    global _op
    with _op_lock:
        if _op is not None:
            return _op
        ext_dir = extensions_dir()
        os.environ["TORCH_EXTENSIONS_DIR"] = str(ext_dir)
        build_dir = ext_dir / "cpu_adam"
        try:
            ext_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DeepSpeedUnavailable(
                f"cannot create the extension cache {ext_dir} ({exc}); set TORCH_EXTENSIONS_DIR to a writable "
                "directory or set optim.backend=torch"
            ) from exc
        clear_stale_lock(build_dir)
        builder = _builder()
        cached = (build_dir / "cpu_adam.so").exists()
        if not cached:
            log.warning(
                "building DeepSpeed's cpu_adam op into %s (first use in this environment, ~1 min with ninja + g++)",
                build_dir,
            )
        t0 = time.perf_counter()
        try:
            with environment_ninja():
                op = builder.load(verbose=False)
        except Exception as exc:
            raise DeepSpeedUnavailable(
                f"building/loading DeepSpeed's cpu_adam op in {build_dir} failed ({type(exc).__name__}: {exc}). "
                "It needs g++ and ninja (pip install ninja); delete that directory to force a clean rebuild, or "
                "set optim.backend=torch"
            ) from exc
        seconds = time.perf_counter() - t0
        flag = builder.simd_width()
        simd = flag.removeprefix("-D__").removesuffix("__")
        _self_test(op)
        _op_info.update(
            dir=str(build_dir), seconds=seconds, built=not cached, simd=simd, lanes=_LANES.get(simd, 0), flag=flag
        )
        log.info(
            "DeepSpeed cpu_adam op %s in %.1f s from %s; SIMD %s (%s fp32 lanes); self-test passed",
            "built" if not cached else "loaded",
            seconds,
            build_dir,
            simd,
            _LANES.get(simd) or "scalable",
        )
        _op = op
        return op


def op_info() -> dict[str, Any]:
    """What :func:`load_op` found: ``dir``, ``seconds``, ``built``, ``simd``, ``lanes``, ``flag``."""
    load_op()
    return dict(_op_info)


_ids = itertools.count(_ID_BASE)


def _self_test(op: ModuleType) -> None:
    """Two steps on 4173 elements (covers the SIMD body and the scalar tail) against the formula."""
    opt_id = next(_ids)
    hyper = Hyper(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1234)
    n = 4096 + 77
    p = torch.randn(n, generator=gen)
    m = torch.zeros(n)
    v = torch.zeros(n)
    ref = [p.numpy().copy(), m.numpy().copy(), v.numpy().copy()]
    powers = BetaPowers(hyper.beta1, hyper.beta2)
    op.create_adam(opt_id, 1e-2, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, True, False)
    try:
        for step in (1, 2):
            g = torch.randn(n, generator=gen)
            op.adam_update(
                opt_id, step, 1e-2, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, True, p, g, m, v
            )
            c = constants(step, 1e-2, hyper, powers)
            ref = list(reference_step(ref[0], g.numpy(), ref[1], ref[2], c))
    finally:
        op.destroy_adam(opt_id)
    for name, got, want in zip(("p", "m", "v"), (p, m, v), ref):
        bad, worst = elements_off(got.numpy(), want)
        if bad:
            raise DeepSpeedUnavailable(
                f"DeepSpeed cpu_adam self-test failed: {bad} of {n} elements of {name} differ from the AdamW formula "
                f"by more than 4 ulp (max {worst:.3g}); delete {extensions_dir()} to "
                "rebuild, or set optim.backend=torch"
            )


class DeepSpeedBackend:
    """One DeepSpeed C++ optimizer (its own id in the op's table) driven chunk by chunk."""

    name = "deepspeed"
    chunk_elems = CHUNK_ELEMS

    def __init__(self, hyper: Hyper) -> None:
        self.hyper = hyper
        self._op = load_op()
        self._id = next(_ids)
        self._op.create_adam(self._id, 1e-3, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, True, False)
        self._closed = False
        self._d64: torch.Tensor | None = None  # undo work buffer, allocated on first use

    @property
    def simd(self) -> str:
        """The SIMD width the op was compiled for, for the start-up log."""
        info = _op_info
        lanes = info.get("lanes") or "scalable"
        return f"{info.get('simd', '?')} ({lanes} fp32 lanes)"

    def step_chunk(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        c: StepConstants,
        scratch: torch.Tensor,
    ) -> None:
        """One ``adam_update`` call on contiguous fp32 chunks (``scratch`` is unused) with ``c``'s weight
        decay: the op takes it per call, so a run of 1-D parameters passes 0 (:mod:`sysx.optim.decay`)."""
        h = self.hyper
        self._op.adam_update(self._id, c.step, c.lr, h.beta1, h.beta2, h.eps, c.weight_decay, True, p, g, m, v)

    def direction_chunk(self, m: torch.Tensor, v: torch.Tensor, c: StepConstants, out: torch.Tensor) -> None:
        """``out = m / fma(sqrt(v), bc2, eps)`` rounded as the op's SIMD body rounds it: numpy's
        fp32 sqrt (hardware, correctly rounded), the fused multiply-add in fp64 (exact product)
        rounded to fp32, then fp32 division (correctly rounded)."""
        k = m.numel()
        if self._d64 is None or self._d64.numel() < k:
            self._d64 = torch.empty(k, dtype=torch.float64)
        d = self._d64[:k]
        np.sqrt(v.numpy(), out=out.numpy())  # correctly rounded fp32 sqrt (torch's is not, always)
        d.copy_(out)
        d.mul_(c.bias_correction2_inv).add_(c.eps)  # the product is exact in fp64
        out.copy_(d)  # fp32 denominator
        torch.div(m, out, out=out)  # fp32 division is correctly rounded, like the kernel's

    def resume_at(self, step: int) -> None:
        """Put the op's running ``b1^t, b2^t`` where ``step`` sequential steps left them
        (``Adam_Optimizer::IncrementStep`` multiplies once per new step and skips repeated calls of
        the same step; a jump would use ``pow``, which rounds differently). The replayed calls update
        a one-element dummy, never the parameters."""
        h = self.hyper
        p, g, m, v = (torch.zeros(1) for _ in range(4))
        for t in range(1, step + 1):
            self._op.adam_update(self._id, t, 0.0, h.beta1, h.beta2, h.eps, h.weight_decay, True, p, g, m, v)

    def close(self) -> None:
        """Remove this optimizer from the op's table."""
        if not self._closed:
            self._closed = True
            self._op.destroy_adam(self._id)


def main(argv: list[str]) -> int:
    """``python -m sysx.optim.deepspeed_backend``: build (or load) the op once and print where."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if argv and argv[0] in ("-h", "--help"):
        print("usage: python -m sysx.optim.deepspeed_backend   (builds DeepSpeed's cpu_adam op into the cache)")
        return 0
    try:
        info = op_info()
    except DeepSpeedUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"cpu_adam op {'built' if info['built'] else 'cached'} in {info['dir']} "
        f"({info['seconds']:.1f} s, SIMD {info['simd']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
