"""CpuAdam: both backends against torch.optim.AdamW and DeepSpeed's formula; undo and snapshot.

The DeepSpeed backend is never skipped: the first test that needs it builds the op into the
per-venv cache (about a minute, once) and fails loudly if that is impossible.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest
import torch

from sysx.optim import CpuAdam
from sysx.optim.bench import REGIMES, measure_undo_error, ulp
from sysx.optim.formula import BetaPowers, Hyper, constants, reference_step

BACKENDS = ["deepspeed", "torch"]
N = 10_007  # not a multiple of any SIMD width: exercises the kernels' scalar tails
EPS32 = torch.finfo(torch.float32).eps


def _state(opt: CpuAdam) -> list[torch.Tensor]:
    return [opt.param.clone(), opt.exp_avg.clone(), opt.exp_avg_sq.clone()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95), (0.5, 0.9)])
def test_tracks_torch_adamw(backend: str, weight_decay: float, betas: tuple[float, float]) -> None:
    """25 steps with a changing learning rate stay within fp32 rounding of torch.optim.AdamW.

    DeepSpeed's constants are fp32 (e.g. 1 - b2 = 1 - fp32(0.999) is 1.3e-5 relative off the
    double value torch uses), so v may differ by ~2e-5 relative and p by a few 1e-5 * lr per step;
    a wrong formula (eps placement, bias correction, decay) would be off by ~lr per step.
    """
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(N, generator=gen) * 0.02
    opt = CpuAdam(p0.clone(), lr=1e-3, betas=betas, weight_decay=weight_decay, backend=backend)
    ref = torch.nn.Parameter(p0.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, betas=betas, eps=1e-8, weight_decay=weight_decay)
    steps = 25
    for s in range(steps):
        lr = 1e-3 * (1 + s) / steps
        g = torch.randn(N, generator=gen) * 1e-2
        opt.step(g, lr=lr)
        ref.grad = g.clone()
        ref_opt.param_groups[0]["lr"] = lr
        ref_opt.step()
    st = ref_opt.state[ref]
    p_ref = ref.detach()
    assert opt.step_count == steps
    torch.testing.assert_close(opt.param, p_ref, rtol=0, atol=steps * 1e-3 * 2e-5 + 8 * EPS32 * 0.1)
    torch.testing.assert_close(opt.exp_avg, st["exp_avg"], rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(opt.exp_avg_sq, st["exp_avg_sq"], rtol=3e-5, atol=1e-12)
    opt.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_deepspeed_formula_per_step(backend: str) -> None:
    """From the same state, one step equals DeepSpeed's formula (numpy, fp64 then fp32).

    DeepSpeed: bit for bit in the SIMD body; its scalar tail (the last ``N % lanes`` elements) does
    not fuse multiply-adds and may differ by 2 ulp. Torch (no FMAs): within 3 ulp everywhere.
    """
    from sysx.optim.deepspeed_backend import op_info

    gen = torch.Generator().manual_seed(3)
    p = torch.randn(N, generator=gen)
    hyper = Hyper(0.9, 0.99, 1e-8, 0.05)
    opt = CpuAdam(p, lr=2e-3, betas=(0.9, 0.99), weight_decay=0.05, backend=backend)
    powers = BetaPowers(0.9, 0.99)
    lanes = op_info()["lanes"] or 1
    body = N - N % lanes
    worst_body, worst_tail = 0.0, 0.0
    for step in range(1, 6):
        g = torch.randn(N, generator=gen)
        before = [t.numpy().copy() for t in _state(opt)]
        opt.step(g)
        want = reference_step(before[0], g.numpy(), before[1], before[2], constants(step, 2e-3, hyper, powers))
        # ulps of the largest magnitude involved (m cancels: m0*b1 and (1-b1)*g can nearly cancel)
        scales = [np.abs(before[0]), np.maximum(np.abs(before[1]), 0.1 * np.abs(g.numpy())), before[2]]
        for got, w, sc in zip(_state(opt), want, scales):
            w_t = torch.from_numpy(np.ascontiguousarray(w))
            e = (got - w_t).abs() / ulp(torch.maximum(w_t.abs(), torch.from_numpy(sc)))
            worst_body = max(worst_body, float(e[:body].max()))
            worst_tail = max(worst_tail, float(e[body:].max()))
    if backend == "deepspeed":
        assert worst_body == 0.0 and worst_tail <= 2.0, (worst_body, worst_tail)
    else:
        assert max(worst_body, worst_tail) <= 3.0, (worst_body, worst_tail)
    opt.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("regime", list(REGIMES))
def test_undo_error_within_measured_bound(backend: str, regime: str) -> None:
    """step + undo restores p, m, v to within 2 ulp of max(|before|, |after step|).

    Measured (see profiling/RESULTS.md): p and m within 1.0 ulp for both backends, v within
    1.0 (deepspeed) / 2.0 (torch, no FMA) ulp; 60-75% of p restored bit for bit after warm-up.
    """
    err = measure_undo_error(backend, regime, n=N)
    for name in "pmv":
        assert err[name].max_ulps <= 2.0, (name, err[name])
    if REGIMES[regime]["warm"] > 0 and REGIMES[regime]["spike"] == 1.0:
        assert err["p"].exact_share > 0.5, err["p"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_snapshot_rollback_is_bit_exact(backend: str) -> None:
    gen = torch.Generator().manual_seed(11)
    opt = CpuAdam(torch.randn(N, generator=gen), lr=1e-2, weight_decay=0.1, backend=backend, rollback="snapshot")
    assert opt.rollback_bytes == 12 * N
    for _ in range(3):
        opt.step(torch.randn(N, generator=gen))
    before = _state(opt)
    opt.step(torch.randn(N, generator=gen) * 1e3, lr=5e-2)
    opt.undo()
    for a, b in zip(_state(opt), before):
        assert torch.equal(a, b)
    assert opt.step_count == 3 and opt.lr == 1e-2
    opt.close()


@pytest.mark.parametrize("rollback", ["undo", "snapshot"])
def test_undo_restores_counter_and_lr_then_continues(rollback: str) -> None:
    """After undo the next step uses the restored step number (bias correction) and lr."""
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(N, generator=gen)
    g1, bad, g2 = (torch.randn(N, generator=gen) for _ in range(3))
    a = CpuAdam(p0.clone(), lr=1e-3, backend="torch", rollback=rollback)
    b = CpuAdam(p0.clone(), lr=1e-3, backend="torch", rollback=rollback)
    a.step(g1)
    b.step(g1)
    a.step(bad, lr=0.5)
    assert a.can_undo
    a.undo(bad)
    assert not a.can_undo and a.step_count == 1 and a.lr == 1e-3
    a.step(g2, lr=2e-3)
    b.step(g2, lr=2e-3)
    if rollback == "snapshot":
        assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))
    else:
        for x, y in zip(_state(a), _state(b)):  # the undo's <= 1 ulp error, carried one step on
            torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-6 * float(y.abs().max()))


def test_undo_errors_are_clear() -> None:
    opt = CpuAdam(torch.zeros(8), lr=1e-3, backend="torch")
    with pytest.raises(RuntimeError, match="no step to undo"):
        opt.undo(torch.zeros(8))
    opt.step(torch.ones(8))
    with pytest.raises(ValueError, match="needs the gradients"):
        opt.undo()
    opt.undo(torch.ones(8))
    with pytest.raises(RuntimeError, match="no step to undo"):
        opt.undo(torch.ones(8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rejects_bad_buffers(backend: str) -> None:
    with pytest.raises(ValueError, match="not contiguous"):
        CpuAdam(torch.zeros(8, 2).t(), lr=1e-3, backend=backend)
    with pytest.raises(TypeError, match="torch.float32"):
        CpuAdam(torch.zeros(8, dtype=torch.float64), lr=1e-3, backend=backend)
    opt = CpuAdam(torch.zeros(16), lr=1e-3, backend=backend)
    with pytest.raises(ValueError, match="not contiguous"):
        opt.step(torch.zeros(32)[::2])  # DeepSpeed would silently leave a non-contiguous view untouched
    with pytest.raises(TypeError, match="float64"):
        opt.step(torch.zeros(16, dtype=torch.float64))  # DeepSpeed would read fp64 bytes as fp32
    with pytest.raises(ValueError, match="15 elements"):
        opt.step(torch.zeros(15))
    with pytest.raises(ValueError, match="backend='nope'"):
        CpuAdam(torch.zeros(4), lr=1e-3, backend="nope")
    with pytest.raises(ValueError, match="betas\\[1\\]=1.0"):
        CpuAdam(torch.zeros(4), lr=1e-3, betas=(0.9, 1.0), backend=backend)
    opt.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_roundtrip(backend: str) -> None:
    gen = torch.Generator().manual_seed(2)
    p = torch.randn(N, generator=gen)
    a = CpuAdam(p, lr=1e-3, weight_decay=0.1, backend=backend)
    for _ in range(3):
        a.step(torch.randn(N, generator=gen))
    b = CpuAdam(p.clone(), lr=0.5, weight_decay=0.1, backend=backend)
    b.load_state_dict(a.state_dict())
    assert b.step_count == 3 and b.lr == a.lr
    g = torch.randn(N, generator=gen)
    a.step(g)
    b.step(g)
    assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))
    c = CpuAdam(p.clone(), lr=1e-3, weight_decay=0.0, backend=backend)
    with pytest.raises(ValueError, match="hyper-parameters"):
        c.load_state_dict(a.state_dict())
    for o in (a, b, c):
        o.close()


def test_deepspeed_chunks_equal_one_call() -> None:
    """Stepping in 1M-element chunks (to release the GIL) gives the bits of one whole-buffer call."""
    from sysx.optim.deepspeed_backend import CHUNK_ELEMS, load_op

    n = 2 * CHUNK_ELEMS + 1_000_003
    gen = torch.Generator().manual_seed(9)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    opt = CpuAdam(p.clone(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, backend="deepspeed")
    opt.step(g)
    op = load_op()
    q, m, v = p.clone(), torch.zeros(n), torch.zeros(n)
    op.create_adam(424242, 1e-3, 0.9, 0.99, 1e-8, 0.1, True, False)
    try:
        op.adam_update(424242, 1, 1e-3, 0.9, 0.99, 1e-8, 0.1, True, q, g, m, v)
    finally:
        op.destroy_adam(424242)
    assert torch.equal(opt.param, q) and torch.equal(opt.exp_avg, m) and torch.equal(opt.exp_avg_sq, v)
    opt.close()


def test_deepspeed_build_is_cached_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    from sysx.optim import cpu_adam
    from sysx.optim.deepspeed_backend import extensions_dir, op_info

    info = op_info()
    assert os.path.exists(os.path.join(info["dir"], "cpu_adam.so"))
    assert info["dir"].startswith(str(extensions_dir()))
    assert info["simd"] in ("AVX512", "AVX256", "NEON", "SVE", "SCALAR")
    cpu_adam._logged.discard("deepspeed")
    with caplog.at_level(logging.INFO, logger="sysx.optim"):
        CpuAdam(torch.zeros(4), lr=1e-3, backend="deepspeed").close()
    assert any("CpuAdam backend: deepspeed" in r.message and info["simd"] in r.message for r in caplog.records)


def test_extensions_dir_choice(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from sysx.optim import deepspeed_backend as ds

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "x"))
    assert ds.extensions_dir() == tmp_path / "x"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(ds.sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(ds.sys, "base_prefix", "/usr")
    (tmp_path / "venv").mkdir()
    assert ds.extensions_dir() == tmp_path / "venv" / "var" / "sysx" / "torch_extensions"
    monkeypatch.setattr(ds.sys, "prefix", "/usr")  # not a venv: user cache, keyed by the interpreter prefix
    d = ds.extensions_dir()
    assert "torch_extensions" in str(d) and f"py{ds.sys.version_info.major}{ds.sys.version_info.minor}" in d.name


def test_the_op_is_built_by_the_environments_ninja_whatever_path_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A process without the venv's ``bin`` on PATH builds with the same ninja as one with it: two
    ninja versions hash the same command differently and rebuilt each other's op (~1 min each)."""
    import shutil

    import ninja
    import torch.utils.cpp_extension as cpp_extension
    from deepspeed.ops.op_builder.builder import OpBuilder

    from sysx.optim import deepspeed_backend as ds

    seen: list[str | None] = []

    def no_build(build_directory: str, verbose: bool, error_prefix: str) -> None:
        seen.append(shutil.which("ninja"))  # what torch's `ninja -v` runs
        raise RuntimeError("stopped before building")

    monkeypatch.setattr(cpp_extension, "_run_ninja_build", no_build)
    monkeypatch.setattr(ds, "_op", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for path in ("/usr/bin:/bin", f"{ninja.BIN_DIR}:/usr/bin:/bin"):
        # as in a new process: DeepSpeed and torch skip the build of an op this process has loaded
        monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
        monkeypatch.setattr(cpp_extension, "JIT_EXTENSION_VERSIONER", type(cpp_extension.JIT_EXTENSION_VERSIONER)())
        monkeypatch.setenv("PATH", path)
        with pytest.raises(ds.DeepSpeedUnavailable, match="stopped before building"):
            ds.load_op()
        assert os.environ["PATH"] == path  # restored after the build
    assert seen == [os.path.join(ninja.BIN_DIR, "ninja")] * 2


def test_the_op_is_built_optimised_without_debug_info() -> None:
    """-g does not change GCC's code but makes the build ~25% longer and the objects 18 MiB each."""
    from sysx.optim.deepspeed_backend import _builder

    args = _builder().cxx_args()
    assert "-O3" in args and "-g" not in args, args


def test_stale_build_lock_is_removed(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    from sysx.optim.deepspeed_backend import STALE_LOCK_S, clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    clear_stale_lock(tmp_path)
    assert lock.exists()  # a fresh lock belongs to a build in progress
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="sysx.optim"):
        clear_stale_lock(tmp_path)
    assert not lock.exists() and "killed build" in caplog.text


def test_auto_backend_falls_back_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    from sysx.optim import deepspeed_backend as ds

    def broken(hyper: Hyper) -> None:
        raise ds.DeepSpeedUnavailable("simulated: no compiler")

    monkeypatch.setattr(ds, "DeepSpeedBackend", broken)
    with pytest.warns(RuntimeWarning, match="FALLING BACK to the torch backend: simulated"):
        opt = CpuAdam(torch.zeros(4), lr=1e-3, backend="auto")
    assert opt.backend == "torch"
    with pytest.raises(ds.DeepSpeedUnavailable, match="simulated"):
        CpuAdam(torch.zeros(4), lr=1e-3, backend="deepspeed")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("numel", [1000, (1 << 20) + 37])  # one chunk per step, and several
def test_resume_from_state_dict_is_bit_identical(backend: str, numel: int) -> None:
    """A fresh optimizer loaded after 7 steps continues exactly like the one that took them: the
    bias corrections are running products (in DeepSpeed's op too) and must be replayed, not pow'ed."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(numel, generator=gen) for _ in range(12)]
    p0 = torch.randn(numel, generator=gen)
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, backend=backend)
    straight = CpuAdam(p0.clone(), **kw)
    for g in grads:
        straight.step(g)
    first = CpuAdam(p0.clone(), **kw)
    for g in grads[:7]:
        first.step(g)
    resumed = CpuAdam(first.param.clone(), **kw)
    resumed.load_state_dict(first.state_dict())
    for g in grads[7:]:
        resumed.step(g)
    assert resumed.step_count == straight.step_count == 12
    for a, b in zip(_state(resumed), _state(straight)):
        assert torch.equal(a, b)
