"""The NVMe tier of the optimizer states (sysx.optim.nvme.tier): the slots' rollback, read-ahead
and write-behind on its own, then bit-identity with host-memory states over 50 steps for the
pipeline (one process) and the sliding window, in fp32, bf16 and fp16 (overflowing), with every
optim.rollback mode. The tests use the threads engine, and DeepSpeed's aio op where it is built
(libaio installed)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from sysx.config import ConfigError, EvalSection, LossScaleSection, ModelSection, OptimSection, SysxConfig, TrainSection
from sysx.optim.cpu_adam import CpuAdam
from sysx.optim.nvme import open_tier as open_tier_module
from sysx.optim.nvme.io import IoError, ThreadsEngine
from sysx.optim.nvme.tier import NvmeTier, TierStage

STEPS = 50


class RecordingEngine:
    """The threads engine, writes slowed down, checking that no read lands in a buffer still being
    written and recording the order of the reads. ``sync_reads``: a read is done when it returns, so
    the tier's completion callback runs inside the call that issued it (as it does whenever a fast
    read beats the tier's ``add_done_callback``)."""

    name = "threads"
    direct = False

    def __init__(self, *, fail_writes: bool = False, sync_reads: bool = False) -> None:
        self.inner = ThreadsEngine(direct=False, threads=2)
        self.sync_reads = sync_reads
        self.writing: set[int] = set()
        self.reads: list[str] = []
        self.overlaps = 0
        self.fail_writes = fail_writes
        self.lock = threading.Lock()

    def read(self, path: str, buf: torch.Tensor, *, offset: int = 0) -> Future[None]:
        with self.lock:
            self.overlaps += buf.data_ptr() in self.writing
            self.reads.append(Path(path).name.split(".")[0])
        done = self.inner.read(path, buf, offset=offset)
        if self.sync_reads:
            done.exception()
        return done

    def write(self, path: str, buf: torch.Tensor, *, offset: int = 0) -> Future[None]:
        if self.fail_writes and Path(path).name.startswith("b"):
            done: Future[None] = Future()
            done.set_exception(IoError(5, f"write of {buf.numel()} bytes at offset 0 of {path} failed: errno 5"))
            return done
        with self.lock:
            self.writing.add(buf.data_ptr())
        done = Future()

        def later() -> None:
            time.sleep(0.01)
            error = self.inner.write(path, buf, offset=offset).exception()
            with self.lock:
                self.writing.discard(buf.data_ptr())  # before the tier hears of it
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        threading.Thread(target=later, daemon=True).start()
        return done

    def close(self) -> None:
        self.inner.close()


def tier_of(tmp_path: Path, stages: list[TierStage], engine, **kw) -> NvmeTier:
    return NvmeTier(stages, engine, lambda name, slot: str(tmp_path / f"{name}.{slot}"), **kw)


def test_two_slots_roll_back_bit_for_bit_like_the_exact_rollback_in_ram(tmp_path: Path) -> None:
    """A step reads one slot and is written to the other; a rollback makes the old slot current
    again: the same bits as rollback=exact in host memory, through steps, rollbacks and final steps."""
    n = 5000
    master = torch.randn(n)
    ram = CpuAdam(master.clone(), lr=1e-2, weight_decay=0.1, backend="torch", rollback="exact")
    tier = tier_of(tmp_path, [TierStage.of("a", n, param_in_ram=False, rollback="exact")], RecordingEngine(), buffers=1)
    st = tier.state("a")
    st.fill(master.clone())
    disk = CpuAdam(None, lr=1e-2, weight_decay=0.1, backend="torch", rollback="exact", store=st)
    try:
        for i, action in enumerate(["step", "step", "undo", "final", "step", "undo", "step"]):
            g = torch.randn(n)
            with st.resident():  # compared in the same residency: what rewrites the working copy
                for opt in (ram, disk):
                    if action == "undo":
                        opt.undo()
                    else:
                        opt.step(g, final=action == "final")
                for a, b in zip((ram.param, ram.exp_avg, ram.exp_avg_sq), (disk.param, disk.exp_avg, disk.exp_avg_sq)):
                    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (i, action)
                del a, b  # views of the staging buffer
        assert st.current == 0  # 4 undoable steps switched the slot, 2 rollbacks switched back, final steps stay
        assert tier.host_bytes == tier.buffer_bytes and ram.rollback_bytes > 0 == disk.rollback_bytes
    finally:
        tier.close()


@pytest.mark.parametrize("sync_reads", [False, True], ids=["reads-later", "reads-done-at-once"])
def test_read_ahead_follows_the_last_use_order_and_a_buffer_waits_for_its_write(
    tmp_path: Path, sync_reads: bool
) -> None:
    """Five stages, three buffers: the first pass reads ahead in registration order, later passes in
    the order of the previous one; no read ever lands in a buffer whose write is in flight, or in
    the buffer a job was just given (a transfer completing inside the call that issued it used to
    start a read-ahead into it); the pace hook hears every transfer."""
    names = ["s4", "s3", "s2", "s1", "s0"]
    engine = RecordingEngine(sync_reads=sync_reads)
    paced: list[tuple[str, int]] = []
    stages = [TierStage.of(n, 3000, param_in_ram=False, rollback="undo") for n in names]
    tier = tier_of(tmp_path, stages, engine, buffers=3, pace=lambda kind, nbytes: paced.append((kind, nbytes)))
    try:
        for name in names:
            tier.state(name).fill(torch.full((3000,), float(int(name[1]))))
        tier.flush()
        order = ["s4", "s3", "s2", "s1", "s0"]
        for _ in range(3):
            for name in order:
                st = tier.state(name)
                with st.resident() as (p, m, v):
                    assert float(p[0]) == float(int(name[1])) + m[0]  # its own bytes
                    m.add_(1.0)
                    p.add_(1.0)
                    st.mark_stale()
                del p, m, v
            order = order[2:] + order[:2]  # the tier learns the new order from use
        for seed in range(4):  # orders it cannot foresee: jobs miss and wait for their reads
            for name in [names[i] for i in torch.randperm(len(names), generator=torch.Generator().manual_seed(seed))]:
                st = tier.state(name)
                with st.resident() as (p, m, v):
                    assert float(p[0]) == float(int(name[1])) + m[0]
                    m.add_(1.0)
                    p.add_(1.0)
                    st.mark_stale()
                del p, m, v
    finally:
        tier.close()  # stops the read-ahead, then waits for every transfer: the counts below are final
    assert engine.overlaps == 0
    first = [names.index(r) for r in engine.reads[:3]]  # the first pass: registration order
    assert first == sorted(first) and len(set(first)) == 3
    assert {k for k, _ in paced} == {"read", "write"} and len(paced) == tier.stats.reads + tier.stats.writes
    assert all(nbytes == stages[0].nbytes for _, nbytes in paced)
    assert tier.stats.hits > 0  # read ahead in time, or still cached


def test_a_failed_write_is_raised_at_the_stage_next_use(tmp_path: Path) -> None:
    engine = RecordingEngine(fail_writes=True)
    tier = tier_of(tmp_path, [TierStage.of("b", 100, param_in_ram=False, rollback="undo")], engine, buffers=1)
    try:
        tier.state("b").fill(torch.zeros(100))
        with pytest.raises(IoError, match="errno 5"), tier.state("b").resident():
            pytest.fail("the stage became resident although its last write failed")
    finally:
        with pytest.raises(IoError):
            tier.close()  # the files are stale: said again at the end


def test_offload_keys_are_checked_in_one_line(tmp_path: Path) -> None:
    for kw, needle in [
        (dict(offload="disk"), "optim.offload=disk"),
        (dict(offload="nvme"), "optim.nvme_dir=None"),
        (dict(offload="nvme", nvme_dir=str(tmp_path / "none")), "no such directory"),
        (dict(nvme_engine="uring"), "optim.nvme_engine=uring"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            OptimSection(**kw).validate()
    OptimSection(offload="nvme", nvme_dir=str(tmp_path)).validate()


# ------------------------------------------------------------------------------- bit identity
def aio_built() -> bool:
    from sysx.optim.deepspeed_backend import extensions_dir

    return (extensions_dir() / "async_io" / "async_io.so").exists()


ENGINE = "aio" if aio_built() else "threads"  # aio only where its op is built (no 2.5 min build in a test)


def config(precision: str, offload: str, nvme_dir: Path, engine: str) -> SysxConfig:
    """A tiny model; every step speculates; bf16 clips every step (each speculative step is rolled
    back and stepped again), fp16 overflows its first steps (loss scale 2**20) and rolls them back."""
    return SysxConfig(
        model=ModelSection(preset="tiny", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64),
        train=TrainSection(steps=STEPS, micro_batch_size=2, micro_batches=1, seq_len=8),
        optim=OptimSection(
            lr=3e-3,
            warmup_steps=2,
            grad_clip=1e-3 if precision == "bf16" else 1.0,
            speculate="always",
            offload=offload,
            nvme_dir=str(nvme_dir) if offload == "nvme" else None,
            nvme_engine=engine,
        ),
        eval=EvalSection(every=0),
        device="cpu",
        precision=precision,
        loss_scale=LossScaleSection(init=2.0**20),
    )


def assert_same(a: tuple, b: tuple) -> None:
    (loss_a, skipped_a, state_a), (loss_b, skipped_b, state_b) = a, b
    assert skipped_a == skipped_b and loss_a == loss_b
    assert set(state_a) == set(state_b)
    assert all(torch.equal(state_a[k].view(torch.int32), state_b[k].view(torch.int32)) for k in state_a)


@pytest.fixture
def few_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """One staging buffer per optimizer worker and none more: fewer than the stages, so every step
    reads and writes the disk."""
    monkeypatch.setattr(open_tier_module, "EXTRA_BUFFERS", 0)


def run_pipeline(cfg: SysxConfig, rollback: str, dataset, *, schedule: str = "sysx", steps: int = STEPS) -> tuple:
    from sysx.runtime import PipelineOptions
    from sysx.trainers.pipeline import PipelineTrainer

    # sysx: 2 stages split in 2; the validate-first baselines: 4 stages on the one rank (mobius)
    layout = {"split": 2} if schedule == "sysx" else {"stages_per_rank": 4}
    opts = PipelineOptions(schedule=schedule, optim_backend="torch", rollback=rollback, optimizer_workers=1, **layout)
    with PipelineTrainer(cfg, opts, dataset=dataset) as t:
        results = t.run(steps)
        tier = t.optimizer.tier
        if tier is not None:
            assert tier.stats.reads > 0 and tier.stats.writes > steps
            held = t.optimizer.host_bytes()["optimizer"]
            assert held < sum(16 * s.numel for s in t.optimizer.stages.values()) + tier.host_bytes
            pool = t.optimizer.scratch  # 16-bit: fp32 gradients converted per job, again at undo / re-step
            if cfg.precision != "fp32":
                assert pool is not None and pool.lent == 0
                assert all(s.grad32 is None for s in t.optimizer.stages.values())
                assert held == tier.host_bytes + 4 * pool.numel * pool.count
                assert t.params.node_plan(t.params.rollback, "nvme").grads == 4 * pool.numel * pool.count  # as planned
        return [r.loss for r in results], [r.skipped for r in results], t.state_dict()


def run_window(cfg: SysxConfig, rollback: str, *, steps: int = STEPS, lane: tuple[str, ...] = ()) -> tuple:
    """``lane``: groups stepped on the device lane (this CPU, after each decision)."""
    import dataclasses

    from sysx.single.hardware import assumed_hardware
    from sysx.trainers.single import SingleTrainer

    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, rollback=rollback))
    hardware = assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=8)
    trainer = SingleTrainer(cfg, hardware=hardware, optimizer_backend="torch", device="cpu")
    try:
        if lane:
            trainer.use_device_lane(lane)
        results = trainer.run(steps)
        tier = trainer.host.tier
        if tier is not None:
            assert tier.stats.reads > 0 and tier.stats.writes > steps
        return [r.loss for r in results], [r.skipped for r in results], trainer.state_dict()
    finally:
        trainer.close()


def compare(run, precision: str, tmp_path: Path) -> list[int]:
    """``run(cfg, rollback)`` on the host and on the tier: undo against undo; the two file slots
    against the host's exact rollback (itself bit-identical to snapshot, tests/test_runtime.py) as
    snapshot in fp32 and as exact otherwise (the tier runs both alike: a step into the other slot).
    The slotted run takes the aio engine where it is built, the others the threads engine. Returns
    the skipped steps of each host run."""
    host = config(precision, "host", tmp_path, "threads")
    slotted = "snapshot" if precision == "fp32" else "exact"
    pairs = [("undo", "undo", config(precision, "nvme", tmp_path, "threads"))]
    pairs.append(("exact", slotted, config(precision, "nvme", tmp_path, ENGINE)))
    skipped = []
    for host_mode, mode, cfg in pairs:
        expected = run(host, host_mode)
        assert_same(run(cfg, mode), expected)
        skipped.append(sum(expected[1]))
    assert list(tmp_path.iterdir()) == []  # the state files are scratch
    return skipped


@pytest.mark.usefixtures("few_buffers", "one_thread")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_pipeline_states_on_nvme_are_bit_identical_to_host_memory(precision: str, tmp_path: Path) -> None:
    """50 steps of the one-process sysx pipeline (4 sub-stages, 1 worker, 1 staging buffer)."""
    from sysx.data import TokenDataset, default_corpus_path

    dataset = TokenDataset(default_corpus_path())
    skipped = compare(lambda cfg, mode: run_pipeline(cfg, mode, dataset), precision, tmp_path)
    assert all(s > 0 for s in skipped) == (precision == "fp16")  # fp16 overflowed and rolled back


@pytest.mark.usefixtures("few_buffers", "one_thread")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_window_states_on_nvme_are_bit_identical_to_host_memory(precision: str, tmp_path: Path) -> None:
    """50 steps of the sliding window (3 groups, 2 staging buffers)."""
    skipped = compare(run_window, precision, tmp_path)
    assert all(s > 0 for s in skipped) == (precision == "fp16")


@pytest.mark.usefixtures("few_buffers", "one_thread")
def test_the_device_lane_steps_states_of_the_tier(tmp_path: Path) -> None:
    """optim.placement=split with the tier: the device lane steps the resident state in place (a
    final step), written back to its slot; bit-identical to the lane over host-memory states."""
    lane = ("embedding+head", "block0")
    host, nvme = (config("bf16", o, tmp_path, "threads") for o in ("host", "nvme"))
    expected = run_window(host, "exact", steps=6, lane=lane)
    assert_same(run_window(nvme, "exact", steps=6, lane=lane), expected)


@pytest.mark.usefixtures("few_buffers", "one_thread")
def test_validate_first_converts_the_pooled_gradients_again_bit_for_bit(tmp_path: Path) -> None:
    """A validate-first schedule (mobius, 4 stages) in bf16 with the tier: each stage's fp32 gradients go back
    to the pool after the check and are converted again, clipped, for the step; 8 steps, every one
    clipped, bit-identical to host memory."""
    import dataclasses

    from sysx.data import TokenDataset, default_corpus_path

    dataset = TokenDataset(default_corpus_path())
    host, nvme = (config("bf16", o, tmp_path, "threads") for o in ("host", "nvme"))
    host, nvme = (dataclasses.replace(c, train=dataclasses.replace(c.train, steps=8)) for c in (host, nvme))
    expected = run_pipeline(host, "undo", dataset, schedule="mobius", steps=8)
    assert_same(run_pipeline(nvme, "undo", dataset, schedule="mobius", steps=8), expected)
