"""Build, load and self-test the out-of-place CpuAdam kernel of ``optim.rollback=exact``.

The kernel (``csrc/exact_adam.cpp``) is DeepSpeed's CPU Adam step written out of place with
streaming stores. It includes DeepSpeed's own ``csrc/includes/simd.h`` and is compiled by
``torch.utils.cpp_extension.load`` with the flags of DeepSpeed's ``CPUAdamBuilder`` (``-O3
-march=native -fopenmp`` and its SIMD define, from :func:`sysx.optim.deepspeed_backend._builder`),
so its arithmetic is DeepSpeed's bit for bit. It is cached beside DeepSpeed's op, in
:func:`sysx.optim.deepspeed_backend.extensions_dir` ``/sysx_exact_adam``. After loading, two steps on
a buffer with a scalar tail are checked against :func:`sysx.optim.formula.reference_step` (within 4 ulp, as
DeepSpeed's own op is: the numpy reference rounds twice where the kernel's FMA rounds once; the
tests check bit for bit against ``DeepSpeedCPUAdam`` itself).
Any failure raises :class:`ExactKernelUnavailable` naming the cause and the fix.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from sysx.optim.formula import BetaPowers, Hyper, StepConstants, constants, elements_off, reference_step

log = logging.getLogger("sysx.optim")

NAME = "sysx_exact_adam"
SOURCE = Path(__file__).with_name("csrc") / "exact_adam.cpp"


class ExactKernelUnavailable(RuntimeError):
    """The out-of-place kernel could not be built, loaded, or failed its self-test."""


_op: ModuleType | None = None
_lock = threading.Lock()


def _flags() -> tuple[list[str], list[str]]:
    """(include dirs, compiler flags): DeepSpeed's CPU Adam include dir and ``CPUAdamBuilder.cxx_args()``."""
    from sysx.optim.deepspeed_backend import DeepSpeedUnavailable, _builder

    try:
        builder = _builder()
        include = [os.path.abspath(builder.deepspeed_src_path(p)) for p in builder.include_paths()]
        cflags = builder.strip_empty_entries(builder.cxx_args()) + ["-UC10_USE_GLOG"]
    except DeepSpeedUnavailable as exc:
        raise ExactKernelUnavailable(str(exc)) from exc
    if not (Path(include[0]) / "simd.h").is_file():
        raise ExactKernelUnavailable(
            f"DeepSpeed's simd.h is not in {include[0]}; reinstall deepspeed (see constraints.txt) or set optim.backend=torch"
        )
    return include, cflags


def load_kernel() -> ModuleType:
    """Build (first use, some 10-30 s) or load the cached kernel and self-test it; once per process."""
    global _op
    with _lock:
        if _op is not None:
            return _op
        from sysx.optim.deepspeed_backend import extensions_dir

        include, cflags = _flags()
        build_dir = extensions_dir() / NAME
        t0 = time.perf_counter()
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            from torch.utils.cpp_extension import load

            op = load(name=NAME, sources=[str(SOURCE)], extra_include_paths=include, extra_cflags=cflags,
                      build_directory=str(build_dir), verbose=False)
        except Exception as exc:
            raise ExactKernelUnavailable(
                f"building/loading the exact-rollback kernel in {build_dir} failed ({type(exc).__name__}: "
                f"{str(exc).strip()[-300:]}). It needs g++ and ninja (pip install ninja); delete that directory to "
                "rebuild, or set optim.backend=torch (torch fallback) or optim.rollback=undo"
            ) from exc
        _self_test(op)
        log.info("exact-rollback kernel loaded in %.1f s from %s (SIMD %s, %d lanes); self-test passed",
                 time.perf_counter() - t0, build_dir, op.simd(), op.simd_width())
        _op = op
        return op


def step_into(op: ModuleType, src: tuple[torch.Tensor, torch.Tensor, torch.Tensor], grad: torch.Tensor,
              dst: tuple[torch.Tensor, torch.Tensor, torch.Tensor], c: StepConstants, *, stream: bool = True) -> None:
    """One step from ``src = (p, m, v)`` into ``dst`` (contiguous fp32 of ``grad``'s length; checked by the caller)."""
    op.step(src[0].data_ptr(), src[1].data_ptr(), src[2].data_ptr(), grad.data_ptr(), dst[0].data_ptr(),
            dst[1].data_ptr(), dst[2].data_ptr(), grad.numel(), c.beta1, c.beta2, c.eps, c.weight_decay,
            c.bias_correction2_inv, c.step_size, c.decay, stream)


def _self_test(op: ModuleType) -> None:
    """Two steps on 4096 + 77 elements (SIMD body, span-1 vectors and scalar tail) against the formula."""
    hyper = Hyper(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1234)
    n = 4096 + 77
    a = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]
    b = [torch.empty(n) for _ in range(3)]
    ref = [t.numpy().copy() for t in a]
    powers = BetaPowers(hyper.beta1, hyper.beta2)
    for step in (1, 2):
        g = torch.randn(n, generator=gen)
        c = constants(step, 1e-2, hyper, powers)
        step_into(op, (a[0], a[1], a[2]), g, (b[0], b[1], b[2]), c)
        ref = list(reference_step(ref[0], g.numpy(), ref[1], ref[2], c))
        a, b = b, a
    for name, got, want in zip("pmv", a, ref):
        bad, _ = elements_off(got.numpy(), want)
        if bad:
            raise ExactKernelUnavailable(
                f"exact-rollback kernel self-test failed: {bad} of {n} elements of {name} differ from DeepSpeed's "
                "AdamW formula; delete the sysx_exact_adam build directory to rebuild, or set optim.rollback=undo"
            )
