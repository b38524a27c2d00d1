"""Per-stage optimizer workers: event hand-over, conversion, local checks, overlap, clean shutdown."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from sysx import trace
from sysx.config import from_yaml, load_config, to_yaml
from sysx.device import Event
from sysx.optim import CpuAdam, OptimizerThreads, StageOptimizer
from sysx.optim.cores import apply_plan, plan_cores, worker_threads_beside


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = threading.active_count()
    yield
    assert threading.active_count() == before, [t.name for t in threading.enumerate()]


def _stage(
    name: str, n: int, *, seed: int, backend: str = "torch", target_dtype=torch.bfloat16, **kw
) -> StageOptimizer:
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen) * 0.02
    target = master.to(target_dtype) if target_dtype is not None else None
    return StageOptimizer(name, master, lr=1e-3, weight_decay=0.1, backend=backend, target=target, **kw)


class GateEvent(Event):
    """A CPU event whose completion the test controls (stands in for a D2H copy in flight)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.gate = threading.Event()
        self.waiting = threading.Event()  # a worker is blocked on this event
        self.released_at = 0.0

    def synchronize(self) -> None:
        self.waiting.set()
        self.gate.wait(timeout=30)

    def release(self) -> None:
        self.released_at = time.perf_counter()
        self.gate.set()


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
def test_worker_converts_unscales_steps_and_writes_target(backend: str) -> None:
    n, scale = 4099, 1024.0
    stage = _stage("s0.0", n, seed=1, backend=backend, target_dtype=torch.float16)
    ref = CpuAdam(stage.master.clone(), lr=1e-3, weight_decay=0.1, backend=backend)
    g_true = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-2
    g16 = (g_true * scale).half()
    with OptimizerThreads([stage], workers=1, threads_per_worker=1) as threads:
        threads.submit_step("s0.0", g16, Event(torch.device("cpu")).record(), scale=scale, lr=2e-3)
        (report,) = threads.wait()
    unscaled = g16.float() / scale
    ref.step(unscaled, lr=2e-3)
    assert report.stepped and not report.found_inf and report.thread.startswith("sysx-opt")
    assert report.sq_norm == pytest.approx(
        float((unscaled.double() ** 2).sum()), rel=1e-7
    )  # fp32 rows of 1024, added in fp64
    assert torch.equal(stage.master, ref.param) and torch.equal(stage.optimizer.exp_avg, ref.exp_avg)
    assert torch.equal(stage.target, stage.master.half())
    stage.close()
    ref.close()


def test_local_overflow_does_not_step() -> None:
    stage = _stage("s1.0", 1000, seed=3)
    master0, target0 = stage.master.clone(), stage.target.clone()
    g = torch.zeros(1000, dtype=torch.bfloat16)
    g[17] = float("nan")
    with OptimizerThreads([stage]) as threads:
        threads.submit_step("s1.0", g, None, lr=1e-3)
        (report,) = threads.wait()
    assert report.found_inf and not report.stepped
    assert torch.equal(stage.master, master0) and torch.equal(stage.target, target0)
    assert stage.optimizer.step_count == 0


def test_worker_waits_for_the_event() -> None:
    stage = _stage("s2.1", 2048, seed=4)
    master0 = stage.master.clone()
    grads = torch.randn(2048).bfloat16()
    event = GateEvent()
    with OptimizerThreads([stage]) as threads:
        threads.submit_step("s2.1", grads, event.record(), lr=1e-3)
        assert event.waiting.wait(timeout=30)  # the worker took the job and waits for the "copy"
        assert torch.equal(stage.master, master0)  # the "copy" is not done: nothing may be read yet
        event.release()
        (report,) = threads.wait()
    assert report.t_ready >= event.released_at and report.stepped
    assert not torch.equal(stage.master, master0)


def test_async_steps_overlap_later_stages_being_fed() -> None:
    """The optimizer of the first sub-stages finishes while later sub-stages are still in backward:
    their steps complete (no ``wait()``, nothing of the later ones submitted as ready) while the
    later sub-stages' gradient copies are still in flight."""
    names = [f"s{i}.0" for i in range(4)]
    stages = [_stage(name, 200_000, seed=10 + i) for i, name in enumerate(names)]
    grads = {name: (torch.randn(200_000) * 1e-2).bfloat16() for name in names}
    later = {name: GateEvent() for name in names[2:]}  # their backward (and gradient copy) still runs
    with OptimizerThreads(stages, workers=2) as threads:
        first = [threads.submit_step(n, grads[n], Event(torch.device("cpu")).record(), lr=1e-3) for n in names[:2]]
        early = [f.result(timeout=60) for f in first]  # done before the later sub-stages are ready
        for name in names[2:]:
            threads.submit_step(name, grads[name], later[name].record(), lr=1e-3)
        for event in later.values():
            event.release()
        reports = {r.stage: r for r in threads.wait()}
    released = min(e.released_at for e in later.values())
    assert all(r.stepped and r.t_done <= released for r in early)
    for name in names:
        r = reports[name]
        assert r.t_submit <= r.t_ready <= r.t_done and r.stepped
    assert all(reports[n].t_ready >= later[n].released_at for n in names[2:])


def test_job_errors_propagate_and_threads_are_joined() -> None:
    stage = _stage("s0.0", 100, seed=5)
    threads = OptimizerThreads([stage], workers=2)
    threads.submit_step("s0.0", torch.zeros(99), None, lr=1e-3)
    with pytest.raises(ValueError, match="99 elements"):
        threads.wait()
    with pytest.raises(KeyError, match="no stage 'nope'"):
        threads.submit_step("nope", torch.zeros(100), None, lr=1e-3)
    threads.close()
    threads.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        threads.submit_step("s0.0", torch.zeros(100), None, lr=1e-3)


def test_ctrl_c_inside_the_block_shuts_workers_down() -> None:
    stage, queued = _stage("s0.0", 50_000, seed=6), _stage("s0.1", 10, seed=7)
    event = GateEvent()
    with pytest.raises(KeyboardInterrupt), OptimizerThreads([stage, queued], workers=1) as threads:
        threads.submit_step("s0.0", torch.zeros(50_000), event, lr=1e-3)
        threads.submit_step("s0.1", torch.zeros(10), None, lr=1e-3)  # queued: cancelled on exit
        assert event.waiting.wait(timeout=30)  # s0.0's job runs (s0.1's is queued behind it)
        releaser = threading.Timer(0.2, event.release)  # the running job finishes while the pool joins
        releaser.start()
        raise KeyboardInterrupt
    releaser.join()
    assert stage.optimizer.step_count == 1 and queued.optimizer.step_count == 0


def test_nvtx_ranges_are_harmless_without_gpu() -> None:
    stage = _stage("s5.1", 1000, seed=8)
    trace.enable(True)
    try:
        with OptimizerThreads([stage]) as threads:
            threads.submit_step("s5.1", torch.randn(1000), None, lr=1e-3)
            (report,) = threads.wait()
        assert report.stepped
    finally:
        trace.enable(False)


def test_core_plan_splits_cores_between_local_ranks(caplog: pytest.LogCaptureFixture) -> None:
    from sysx.optim.cores import usable_physical_cores

    cores, affinity = usable_physical_cores()
    plan = plan_cores(n_stages=6, backend="deepspeed", local_rank=0, local_world_size=1)
    assert plan.cores_per_rank == cores and plan.optimizer_workers == 1 and plan.threads_per_worker == cores
    assert set(plan.cpus) <= set(affinity)
    two = [plan_cores(n_stages=6, backend="torch", local_rank=r, local_world_size=2) for r in (0, 1)]
    assert all(p.cores_per_rank == max(1, cores // 2) for p in two)
    assert all(p.optimizer_workers * p.threads_per_worker <= max(1, cores // 2) for p in two)
    if len(affinity) >= 2:
        assert not set(two[0].cpus) & set(two[1].cpus)
    many = plan_cores(n_stages=2, backend="torch", local_rank=3, local_world_size=4 * cores)
    assert many.oversubscribed and many.cores_per_rank == 1
    with pytest.raises(ValueError, match="local_rank=2"):
        plan_cores(n_stages=1, local_rank=2, local_world_size=2)
    saved = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="sysx.optim"):
            apply_plan(plan)
        assert torch.get_num_threads() == plan.cores_per_rank
        assert "core plan: local rank 0/1" in caplog.text
    finally:
        torch.set_num_threads(saved)


def _bound_cpus(local_rank: int, local_world_size: int) -> tuple[list[int], list[int]]:
    """In a child process: bind as rank ``local_rank`` of ``local_world_size``; the CPUs of the
    process and of a thread it starts afterwards (an optimizer worker's)."""
    from sysx.optim.cores import NODE_CPUS_ENV, bind_to, usable_physical_cores

    os.environ.pop(NODE_CPUS_ENV, None)
    before = usable_physical_cores()
    bind_to(plan_cores(n_stages=1, local_rank=local_rank, local_world_size=local_world_size))
    # the plan (the tune's included) still sees the job's cores, not the rank's slice
    assert usable_physical_cores() == before, (usable_physical_cores(), before)
    seen: list[list[int]] = []
    t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
    t.start()
    t.join()
    os.environ.pop(NODE_CPUS_ENV)
    return sorted(os.sched_getaffinity(0)), seen[0]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning needs Linux's sched_setaffinity")
def test_bound_ranks_keep_to_their_own_cpus_and_share_evenly_when_oversubscribed() -> None:
    """``parallel.bind_cores``: each rank's process and the threads it starts later keep to its
    slice of the mask; with more ranks than CPUs neighbouring ranks share one, every CPU used."""
    import concurrent.futures
    import multiprocessing

    from sysx.optim.cores import usable_physical_cores

    _, affinity = usable_physical_cores()
    n = len(affinity)
    for lws in (1, n, 2 * n + 1):
        plans = [plan_cores(n_stages=1, local_rank=r, local_world_size=lws) for r in range(lws)]
        assert all(p.cpus and set(p.cpus) <= set(affinity) for p in plans), lws
        assert sorted({c for p in plans for c in p.cpus}) == affinity, lws  # no CPU left out
        if lws <= n:
            assert sum(len(p.cpus) for p in plans) == n // lws * lws  # disjoint slices
        else:  # one CPU each, no CPU with two ranks more than another
            assert all(len(p.cpus) == 1 for p in plans), [p.cpus for p in plans]
            per_cpu = [sum(p.cpus == (c,) for p in plans) for c in affinity]
            assert max(per_cpu) - min(per_cpu) <= 1, per_cpu
    ctx = multiprocessing.get_context("spawn")  # the test's own process keeps its mask
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        for lws, r in ((1, 0), (n, n - 1), (2 * n + 1, 2 * n)):
            own, thread = pool.submit(_bound_cpus, r, lws).result(timeout=120)
            want = sorted(plan_cores(n_stages=1, local_rank=r, local_world_size=lws).cpus)
            assert own == want and thread == want, (lws, r, own, thread)
            pool.submit(os.sched_setaffinity, 0, set(affinity)).result(timeout=120)  # unpin for the next


@pytest.mark.parametrize(
    ("mask", "online", "cores", "ranks", "device", "gpus", "visible", "pinned"),
    [
        ([0, 1], 2, 2, 2, "cpu", 0, None, True),  # two ranks fill two cores
        ([0, 1], 2, 2, 4, "cpu", 0, None, True),  # oversubscribed: contended either way
        (list(range(16)), 16, 16, 2, "cpu", 0, None, False),  # 14 cores free for other work
        (list(range(16)), 16, 16, 1, "auto", 0, None, False),  # device=auto without CUDA is the CPU
        ([4, 5, 6, 7], 16, 4, 1, "cpu", 0, None, True),  # a cpuset gave the job these CPUs
        (list(range(64)), 64, 32, 8, "cuda", 8, None, True),  # one rank per GPU of the node
        (list(range(64)), 64, 32, 4, "cuda", 8, None, False),  # half the GPUs: others may run here
        (list(range(64)), 64, 32, 4, "auto", 4, "0,1,2,3", False),  # a scheduler hid the other GPUs
        ([0, 1], 2, 2, 4, "emulated", 0, None, False),  # emulated ranks stand for GPUs
    ],
)
def test_auto_binding_pins_ranks_that_have_their_cpus_to_themselves(
    monkeypatch: pytest.MonkeyPatch,
    mask: list[int],
    online: int,
    cores: int,
    ranks: int,
    device: str,
    gpus: int,
    visible: str | None,
    pinned: bool,
) -> None:
    """``parallel.bind_cores=auto``: pin when the inherited mask is narrower than the node or the
    ranks fill it (every GPU, or every core on the CPU); never on the emulated device; true and
    false are taken as given. The reason names what decided."""
    from sysx.optim import cores as cores_mod

    monkeypatch.setattr(cores_mod, "usable_physical_cores", lambda: (cores, mask))
    monkeypatch.setattr(cores_mod.os, "cpu_count", lambda: online)
    monkeypatch.setattr(cores_mod.torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(cores_mod.torch.cuda, "device_count", lambda: gpus)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    bind, why = cores_mod.bind_choice("auto", local_world_size=ranks, device=device)
    assert bind is pinned and why.startswith("auto: "), (bind, why)
    for setting in (True, False):
        assert cores_mod.bind_choice(setting, local_world_size=ranks, device=device) == (
            setting,
            f"parallel.bind_cores={str(setting).lower()}",
        )


def test_bind_cores_reads_auto_true_and_false_as_yaml_and_hydra_give_them() -> None:
    """Hydra's ``true`` reaches the string key as ``"True"``; a saved run's YAML round-trips."""
    from sysx.config.choices import bind_setting

    assert bind_setting(load_config([]).parallel.bind_cores) == "auto"
    assert bind_setting(load_config(["parallel.bind_cores=true"]).parallel.bind_cores) is True
    assert bind_setting(load_config(["parallel.bind_cores=False"]).parallel.bind_cores) is False
    cfg = load_config(["parallel.bind_cores=false"])
    assert bind_setting(from_yaml(to_yaml(cfg)).parallel.bind_cores) is False


def test_workers_beside_the_hosts_own_compute_step_with_one_thread() -> None:
    """Where the host computes, a worker's own OpenMP team would stop the compute team's idle
    threads spinning (libgomp's count of threads against CPUs); beside a GPU it takes torch's count."""
    assert worker_threads_beside(torch.device("cpu")) == 1
    assert worker_threads_beside(torch.device("cuda", 0)) is None
    assert worker_threads_beside(torch.device("cuda")) is None


def test_a_workers_thread_count_leaves_the_creating_threads_own() -> None:
    """torch.set_num_threads in a worker also sets the count a thread takes at its first parallel
    op: the creating thread (a rank's main thread after apply_plan, before it computes) keeps its own."""
    stage = _stage("s0.0", 64, seed=1)
    saved = torch.get_num_threads()
    seen: dict[str, int] = {}

    def create() -> None:  # a thread that has not computed yet
        torch.set_num_threads(3)
        with OptimizerThreads([stage], workers=1, threads_per_worker=1) as threads:
            seen["worker"] = threads._executor().submit(torch.get_num_threads).result(timeout=60)
        seen["creator"] = torch.get_num_threads()

    creator = threading.Thread(target=create)
    creator.start()
    creator.join(timeout=120)
    torch.set_num_threads(saved)  # the default of later threads, which the workers moved
    assert seen == {"worker": 1, "creator": 3}


def test_core_plan_reads_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    plan = plan_cores(n_stages=3)
    assert (plan.local_rank, plan.local_world_size) == (1, 2)


def test_per_job_gradients_reuse_the_scratch_pool() -> None:
    """16-bit groups convert per job (keep_grads=False) into a shared pool, not a fresh block-sized
    tensor each time (a fresh mmap page-faults in again: 8x slower to fill on the CPU machine);
    the steps are the same as with fresh tensors, and a pool lent out falls back to temporaries."""
    from sysx.optim.scratch import ScratchPool

    n, steps = 1000, 3
    pool = ScratchPool(n, 2)
    pooled = [_stage(f"s{i}", n - i, seed=i, keep_grads=False, scratch=pool) for i in range(4)]
    plain = [_stage(f"s{i}", n - i, seed=i, keep_grads=False) for i in range(4)]
    grads = [torch.randn(n - i, generator=torch.Generator().manual_seed(10 + i)).bfloat16() for i in range(4)]
    for stages in (pooled, plain):
        with OptimizerThreads(stages, workers=2, threads_per_worker=1) as threads:
            for _ in range(steps):
                for s, g in zip(stages, grads):
                    threads.submit_step(s.name, g, Event(torch.device("cpu")).record(), scale=1.0, lr=1e-3)
                threads.wait()
    assert all(torch.equal(a.master, b.master) and torch.equal(a.target, b.target) for a, b in zip(pooled, plain))
    assert pool.lent == 0 and pool._made <= 2  # every job gave its buffer back; never more than the pool holds
    held = [pool.take(n), pool.take(n)]
    extra = pool.take(n)  # all lent: a temporary, not a third pooled buffer
    pool.give(extra)
    assert pool._made == 2 and pool.lent == 2 and extra.data_ptr() not in {t.data_ptr() for t in held}
    for s in pooled + plain:
        s.close()
