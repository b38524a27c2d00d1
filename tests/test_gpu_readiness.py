"""Issue 17 (GPU readiness), the logic that a CPU can check: which backend and GPU a process gets,
what the planner does with an out-of-memory, what the executor allocates, which env DeepSpeed
sees, how op times and offload events are taken, how a memory cap is restored, which peak an MFU
uses. CUDA calls are replaced by stand-ins; what only a GPU can confirm is run by
``profiling/gpu_check.sh``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from sysx import device as dev
from sysx.config import EvalSection, ModelSection, OptimSection, SysxConfig, TrainSection, validate
from sysx.device_binding import DeviceBindingError, backend_for, local_device
from sysx.device_memory import DeviceUsage, MemoryCap, over_budget
from sysx.model import get_preset
from sysx.model.flat import FlatLayout
from sysx.model.llama import init_layer, make_layer, make_shell

ROOT = Path(__file__).resolve().parents[1]
TINY = get_preset("tiny")


# ------------------------------------------------------------------------------ items 2 and 4
@pytest.mark.parametrize(
    ("device", "cuda", "backend"),
    [
        ("cpu", True, "gloo"),
        ("cuda", True, "nccl"),
        ("cuda:1", True, "nccl"),
        ("auto", True, "nccl"),
        ("auto", False, "gloo"),
        (torch.device("cpu"), True, "gloo"),
    ],
)
def test_the_backend_follows_the_resolved_device_not_the_presence_of_cuda(
    monkeypatch: pytest.MonkeyPatch, device: object, cuda: bool, backend: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert backend_for(device) == backend


def test_more_processes_per_node_than_gpus_is_refused_in_one_line() -> None:
    assert [local_device(r, 4, 8) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(DeviceBindingError) as err:
        local_device(2, 4, 2)  # today's modulo would put ranks 0 and 2 on GPU 0
    assert "4 processes on this node but only 2 GPU(s)" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DeviceBindingError, match="no GPU"):
        local_device(0, 1, 0)


def test_default_device_uses_the_gpu_chosen_at_init_and_refuses_oversubscription(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "0")  # the environment disagrees: the process group's choice wins
    assert dev.default_device() == torch.device("cuda", 1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert dev.default_device() == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(DeviceBindingError):
        dev.default_device()


# ----------------------------------------------------------------------------------- item 1
def test_planning_sizes_chunks_from_meta_and_runs_only_the_chosen_size_treating_oom_as_no_fit() -> None:
    from sysx.single.hardware import assumed_hardware
    from sysx.single.plan_costs import meta_profiler
    from sysx.single.plan_request import PlanError, PlanRequest
    from sysx.single.planner import make_plan

    meta = meta_profiler(TINY, 128, torch.float32)
    asked: list[int] = []

    def device_profiler(b: int, seq_chunk: int):  # a stand-in for the GPU: out of memory above 2 sequences
        asked.append(b)
        if b > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return meta(b, seq_chunk)

    req = PlanRequest(
        model=TINY,
        seq_len=128,
        global_batch=16,
        precision="fp32",
        device_budget_bytes=8 << 30,
        host_budget_bytes=4 << 30,
        round_sequences=16,
    )
    hw = assumed_hardware("rtx4090")
    free = make_plan(req, hw, profiler=meta)
    assert free.chunk > 2  # the budget alone allows more than the stand-in device can run
    plan = make_plan(req, hw, profiler=device_profiler)
    assert plan.chunk == 2
    assert sorted(set(asked), reverse=True) == [
        d for d in (16, 8, 4, 2) if d <= free.chunk
    ]  # largest fitting first, no others
    with pytest.raises(PlanError, match="single.micro_batch_size=4: the device ran out of memory"):
        make_plan(PlanRequest(**{**req.__dict__, "chunk": 4}), hw, profiler=device_profiler)


# ----------------------------------------------------------------------------------- item 3
def test_executor_shells_hold_no_weights_and_compute_like_full_layers() -> None:
    from sysx.runtime.executor import Executor

    ex = Executor.__new__(Executor)  # only what _layers_modules reads
    ex.model_cfg, ex.dtype, ex.device, ex._modules = TINY, torch.float32, torch.device("cpu"), {}
    mods, layout = ex._layers_modules(range(0, TINY.n_layers + 2))
    held = sum(p.untyped_storage().nbytes() for m in mods for p in m.parameters())
    assert layout.numel > 400_000 and held <= 4 * len(layout.entries)  # one element per parameter, not the unit
    assert not any(p.is_meta for m in mods for p in m.parameters())
    ref = make_layer(TINY, 1)
    init_layer(ref, 1, seed=3)
    shell = make_shell(TINY, 1)
    FlatLayout.from_modules([shell]).bind([shell], FlatLayout.from_modules([ref]).flatten([ref]))
    x = torch.randn(2, 8, TINY.dim)
    assert torch.equal(shell(x), ref(x))


def tiny_cpu_cfg(*, steps: int, micro_batches: int, warmup_steps: int) -> SysxConfig:
    """The tiny model on the CPU, micro-batches of 2 sequences of 16 tokens, no evaluation (validated)."""
    cfg = SysxConfig(
        model=ModelSection(preset="tiny"),
        train=TrainSection(steps=steps, micro_batch_size=2, micro_batches=micro_batches, seq_len=16),
        optim=OptimSection(warmup_steps=warmup_steps),
        eval=EvalSection(every=0, batches=1),
        device="cpu",
    )
    validate(cfg)
    return cfg


# ---------------------------------------------------------------------------------- item 13
def test_parameters_are_bound_once_per_slot_and_unit_not_per_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from sysx.data import TokenDataset, default_corpus_path
    from sysx.runtime import PipelineOptions
    from sysx.trainers.pipeline import PipelineTrainer

    binds: list[int] = []
    real = FlatLayout.bind
    monkeypatch.setattr(FlatLayout, "bind", lambda self, mods, buf: (binds.append(1), real(self, mods, buf))[1])
    cfg = tiny_cpu_cfg(steps=3, micro_batches=4, warmup_steps=2)
    trainer = PipelineTrainer(
        cfg, PipelineOptions(optim_backend="torch", schedule="gpipe"), dataset=TokenDataset(default_corpus_path())
    )
    try:
        trainer.run(1)
        first = len(binds)
        ops = sum(1 for o in trainer.ops if o.kind.name in ("FORWARD", "BACKWARD"))
        trainer.run(2)
    finally:
        trainer.close()
    assert 0 < first < ops  # 4 micro-batches x (F + B) share one binding per unit
    assert len(binds) == first  # later steps reuse the same slots: no rebinding at all


@pytest.mark.parametrize("schedule", ["sysx", "single"])
def test_a_cpu_job_on_a_gpu_machine_page_locks_nothing(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host memory is page-locked for the job's device, not for the presence of CUDA: a device=cpu job
    on a GPU machine registered its shared segments and gradient buffers with cudaHostRegister,
    creating a CUDA context in every rank (tens of MiB of host memory each, first seen on an H200's
    host). CUDA is faked present here; registering anything is a failure."""
    from sysx.data import TokenDataset, default_corpus_path
    from sysx.memory import pinned
    from sysx.runtime import PipelineOptions
    from sysx.trainers.pipeline import PipelineTrainer
    from sysx.trainers.single import SingleTrainer

    registered: list[int] = []

    class _Cudart:
        def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
            registered.append(nbytes)
            return 0

        def cudaHostUnregister(self, address: int) -> int:
            return 0

    monkeypatch.setattr(pinned, "_cuda_available", lambda: True)
    monkeypatch.setattr(pinned, "_cudart", _Cudart)
    pinned.HostBuffers("the fake's own check").empty(16, torch.float32)  # pin=None: CUDA "present"
    assert registered == [64]
    registered.clear()
    cfg = tiny_cpu_cfg(steps=1, micro_batches=2, warmup_steps=1)
    if schedule == "single":
        trainer: PipelineTrainer | SingleTrainer = SingleTrainer(cfg, optimizer_backend="torch")
    else:
        dataset = TokenDataset(default_corpus_path())
        trainer = PipelineTrainer(cfg, PipelineOptions(optim_backend="torch", schedule=schedule), dataset=dataset)
    try:
        trainer.run(1)
    finally:
        trainer.close()
    assert registered == [], f"a device=cpu job page-locked {len(registered)} buffers ({sum(registered)} bytes)"


# ----------------------------------------------------------------------------------- item 6
class _FakeCuda:
    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.calls: list[float] = []

    def set(self, value: float, device: object = None) -> None:
        self.calls.append(value)
        self.fraction = value


def test_the_memory_cap_is_restored_when_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCuda(0.7)  # a cap some earlier code set
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fake.set)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fake.fraction)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: type("P", (), {"total_memory": 80 << 30})()
    )
    cap = MemoryCap(torch.device("cuda", 0), 20 << 30)
    assert cap.active and fake.fraction == 0.25
    cap.close()
    cap.close()
    assert fake.calls == [0.25, 0.7] and not cap.active
    MemoryCap(torch.device("cpu"), 20 << 30).close()
    assert fake.calls == [0.25, 0.7]


def test_the_budget_check_counts_reserved_memory_and_the_process_nvml_usage() -> None:
    budget = 10 << 30
    ok = DeviceUsage(
        peak_allocated=6 << 30,
        peak_reserved=9 << 30,
        process_nvml=9_900 << 20,
        device_nvml=None,
        free=0,
        total=80 << 30,
    )
    assert over_budget(ok, budget) == []
    reserved = DeviceUsage(6 << 30, 11 << 30, None, None, 0, 80 << 30)  # allocated alone would pass
    assert [m.split()[0] for m in over_budget(reserved, budget)] == ["peak"]
    context = DeviceUsage(6 << 30, 9 << 30, 11 << 30, None, 0, 80 << 30)
    assert "CUDA context" in over_budget(context, budget)[0]


# ----------------------------------------------------------------------------------- item 7
@pytest.mark.parametrize("cuda", [True, False])
def test_ds_accelerator_cpu_is_set_only_without_cuda(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    from sysx.optim.deepspeed_backend import quiet_cpu_accelerator

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    quiet_cpu_accelerator()
    import os

    assert os.environ.get("DS_ACCELERATOR") == (None if cuda else "cpu")


# ----------------------------------------------------------------------------------- item 8
class _FakeEvent:
    clock: ClassVar[list[float]] = [0.0]

    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.timing, self.blocking, self.at, self.synced = enable_timing, blocking, None, False

    def record(self, stream: object = None) -> None:
        _FakeEvent.clock[0] += 2.5  # the "GPU" advances 2.5 ms between marks
        self.at = _FakeEvent.clock[0]

    def synchronize(self) -> None:
        self.synced = True

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.at - self.at


def test_op_times_on_cuda_come_from_timing_events_and_on_cpu_from_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[_FakeEvent] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: made.append(_FakeEvent(**kw)) or made[-1])
    timer = dev.OpTimer(torch.device("cuda", 0))
    for label in ("FORWARD", "BACKWARD", "FORWARD"):
        timer.stop(label, timer.start())
    assert timer.seconds() == pytest.approx({"FORWARD": 0.005, "BACKWARD": 0.0025})
    assert all(e.timing for e in made) and made[-1].synced and made[-1].blocking
    cpu = dev.OpTimer("cpu")
    cpu.stop("FORWARD", cpu.start())
    assert list(cpu.seconds()) == ["FORWARD"] and len(made) == 6  # no event on CPU


def test_offload_events_are_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[_FakeEvent] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: made.append(_FakeEvent(**kw)) or made[-1])
    dev.Stream(torch.device("cuda", 0), raw=object()).record_event(blocking=True)
    dev.Event(torch.device("cuda", 0))
    assert [e.blocking for e in made] == [True, False]


@pytest.mark.parametrize(
    ("name", "precision", "tf32", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", False, 989.4),
        ("NVIDIA H100 PCIe", "bf16", False, 756.5),
        ("NVIDIA H100 NVL", "bf16", False, 835.5),
        ("NVIDIA H200", "bf16", False, 989.4),
        ("NVIDIA H100 80GB HBM3", "fp32", True, 494.7),
        ("NVIDIA H100 80GB HBM3", "fp32", False, 66.9),
        ("NVIDIA H100 PCIe", "fp32", False, 51.2),
        ("NVIDIA H100 XYZ", "bf16", False, None),
        ("H100", "bf16", False, None),
    ],
)
def test_mfu_peaks_match_gpu_names_exactly_and_fp32_counts_tf32_only_when_enabled(
    name: str, precision: str, tf32: bool, peak: float | None
) -> None:
    sys.path.insert(0, str(ROOT / "profiling"))
    try:
        from bench_single import gpu_peak
    finally:
        sys.path.remove(str(ROOT / "profiling"))
    assert gpu_peak(name, precision, tf32=tf32) == peak


# ---------------------------------------------------------------------------------- item 11
def test_optimizer_workers_set_the_cuda_device_in_their_initialiser(monkeypatch: pytest.MonkeyPatch) -> None:
    from sysx.optim.stage import StageOptimizer
    from sysx.optim.threads import OptimizerThreads, worker_device

    seen: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append((threading.current_thread().name, d)))
    stage = StageOptimizer("s0", torch.zeros(8), lr=1e-3, backend="torch")
    with OptimizerThreads([stage], workers=2, device=torch.device("cuda", 1), name="opt-test") as threads:
        threads.run_all(lambda s: s.name, ["s0", "s0"], "noop")
    assert seen and all(name.startswith("opt-test") and d == torch.device("cuda", 1) for name, d in seen)
    assert worker_device("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert worker_device(None) is None  # a CPU job on a GPU machine creates no context
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert worker_device(None) == torch.device("cuda", 3)
    # "cuda" without an index (device=cuda handed straight to a trainer): torch.cuda.set_device
    # refuses it in the worker's initialiser, which broke every optimizer job on the first GPU run
    assert worker_device("cuda") == torch.device("cuda", 3)


def test_a_closed_stage_optimizer_lets_its_page_locked_buffers_go() -> None:
    """CPU twin of the first GPU run's gpipe failure: the pipeline's host gradient buffers are
    mapped (page-locked) only with CUDA, and a stage optimizer still held by a worker pool's table
    after close() kept a view of one, so unmapping raised LiveViewsError."""
    from sysx.memory.pinned import PinnedStaging
    from sysx.optim.stage import StageOptimizer

    staging = PinnedStaging(8 * 4, label="grad buffer", pin=False)  # the same mapping, unpinned
    stage = StageOptimizer("s0", torch.zeros(8), lr=1e-3, backend="torch", grad_buffer=staging.view(torch.float32, 8))
    still_held = {"s0": stage}
    stage.load_grads(torch.ones(8), scale=1.0)
    stage.close()
    staging.close()  # raised LiveViewsError before close() dropped the views
    assert staging.closed and still_held


def test_a_failed_step_s_error_is_not_hidden_by_its_live_views_when_the_trainer_closes() -> None:
    """CPU twin of the second H200 lease's sanitizer failure: the failed op's frames held views of
    sub-stage s1.2's shared memory, so ``close()`` in a ``finally`` raised LiveViewsError over the
    real error and left the store open. Closing on the way out of a failure clears those frames."""
    from sysx.runtime import ExecutionError, PipelineOptions
    from sysx.schedule.ops import OpKind
    from sysx.trainers.pipeline import PipelineTrainer

    trainer = PipelineTrainer(
        tiny_cpu_cfg(steps=1, micro_batches=2, warmup_steps=1), PipelineOptions(optim_backend="torch", schedule="sysx")
    )
    executor = trainer.runtime.executor

    def fails_holding_a_view(op: object) -> None:
        pieces = executor.params.pieces(op.stage, op.sub)  # type: ignore[attr-defined]
        raise RuntimeError(f"injected, holding {len(pieces)} views of the store")

    executor.handlers[OpKind.BACKWARD] = fails_holding_a_view
    with pytest.raises(ExecutionError, match="injected"):
        try:
            trainer.run(1)
        finally:
            trainer.close()
    assert trainer.runtime.params.store._stages == {}  # every segment closed, none left to exit hooks


# ---------------------------------------------------------------------------------- item 12
def test_no_pinned_allocation_bypasses_the_exact_size_registration() -> None:
    pattern = re.compile(r"pin_memory\s*=\s*True|\.pin_memory\(")
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in (ROOT / "sysx").rglob("*.py")
        if p.name != "pinned.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == [], f"use sysx.memory.pinned.HostBuffers instead of the power-of-two caching host allocator: {hits}"


# ---------------------------------------------------------------------------------- item 14
def test_default_precision_is_bf16_on_a_gpu_and_fp32_on_cpu() -> None:
    assert dev.default_precision(torch.device("cuda", 0)) == "bf16"
    assert dev.default_precision("cpu") == "fp32"


def test_precision_auto_is_the_config_default_and_resolves_for_the_job_device() -> None:
    from sysx.config import SysxConfig
    from sysx.trainers.base import resolve_precision

    cfg = SysxConfig()
    assert cfg.precision == "auto"
    assert resolve_precision(cfg, "cpu").precision == "fp32"
    assert resolve_precision(cfg, torch.device("cuda", 0)).precision == "bf16"
    explicit = SysxConfig(precision="fp16")
    assert resolve_precision(explicit, torch.device("cuda", 0)) is explicit  # a set value is never changed


# ------------------------------------------------------------------------------ items 5, 9, 10
class _Work:
    """A stand-in for ``dist.Work`` that notes how it was waited for."""

    def __init__(self, log: list[tuple[str, object]]) -> None:
        self.log = log

    def wait(self, timeout: object = None) -> bool:
        self.log.append(("wait", timeout))
        return True

    def is_completed(self) -> bool:
        return True


@pytest.fixture()
def fake_p2p(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """dist.isend/irecv and the bounded host wait replaced by stand-ins that log their calls."""
    import sysx.runtime.p2p as p2p_mod

    log: list[tuple[str, object]] = []

    def post(kind: str):
        def call(tensor: torch.Tensor, *args: object, group: object = None, **kw: object) -> _Work:
            log.append((kind, group))
            return _Work(log)

        return call

    monkeypatch.setattr(p2p_mod.dist, "isend", post("isend"))
    monkeypatch.setattr(p2p_mod.dist, "irecv", post("irecv"))
    monkeypatch.setattr(p2p_mod, "wait_for", lambda work, **kw: log.append(("host_wait", kw["timeout_s"])))
    return log


def _spec(kind: object) -> object:
    from sysx.runtime.p2p import TransferSpec

    return TransferSpec(kind, 1, 0, 0, (2, 3), torch.float32)


def test_on_nccl_synchronous_transfers_order_the_stream_and_only_wait_ckpt_and_validate_block_the_host(
    fake_p2p: list[tuple[str, object]],
) -> None:
    from sysx.runtime.p2p import P2P
    from sysx.schedule.ops import Message

    p2p = P2P(0, device=torch.device("cpu"), timeout_s=30, verify=False, stream_ordered=True)
    p2p.send(torch.zeros(2, 3), _spec(Message.ACT), 1, "F s1 mb0")
    p2p.recv(_spec(Message.GRAD), 1, "B s1.0 mb0")
    assert ("host_wait", 30.0) not in fake_p2p and fake_p2p.count(("wait", None)) == 2  # Work.wait() with no timeout
    fake_p2p.clear()
    p2p.wait(p2p.irecv(_spec(Message.CKPT), 1, "WAIT_CKPT s1.0 mb0"))  # the executor's WAIT_CKPT and VALIDATE path
    assert fake_p2p[-1] == ("host_wait", 30.0)
    fake_p2p.clear()
    checked = P2P(0, device=torch.device("cpu"), timeout_s=30, verify=True, stream_ordered=True)
    checked.isend(torch.zeros(2, 3), _spec(Message.ACT), 1, "F s1 mb0")  # a header to check needs the host
    gloo = P2P(0, device=torch.device("cpu"), timeout_s=30, verify=False, stream_ordered=False)
    gloo.send(torch.zeros(2, 3), _spec(Message.ACT), 1, "F s1 mb0")
    assert fake_p2p[-1] == ("host_wait", 30.0)


def test_checkpoint_messages_travel_on_their_own_group(fake_p2p: list[tuple[str, object]]) -> None:
    from sysx.runtime.p2p import P2P
    from sysx.schedule.ops import Message

    main, ckpt = object(), object()
    p2p = P2P(
        0, device=torch.device("cpu"), timeout_s=30, verify=True, group=main, ckpt_group=ckpt, stream_ordered=False
    )
    p2p.isend(torch.zeros(2, 3), _spec(Message.CKPT), 1, "SEND_CKPT")
    p2p.irecv(_spec(Message.CKPT), 1, "RECV_CKPT")
    p2p.isend(torch.zeros(2, 3), _spec(Message.ACT), 1, "SEND_ACT")
    p2p.irecv(_spec(Message.GRAD), 1, "RECV_GRAD")
    posts = [entry for entry in fake_p2p if entry[0] in ("isend", "irecv")]
    assert posts == [("isend", ckpt)] * 2 + [("irecv", ckpt)] * 2 + [("isend", main)] * 2 + [("irecv", main)] * 2
    shared = P2P(0, device=torch.device("cpu"), timeout_s=30, verify=False, group=main, stream_ordered=False)
    assert shared.ckpt_group is main  # no separate group given: one group for everything


def test_the_process_group_timeout_is_a_multiple_of_the_per_wait_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime

    from sysx import dist as sdist

    assert sdist.process_group_timeout_s(300) >= 4 * 300
    assert sdist.process_group_timeout_s(5) >= 5 + 60  # short test timeouts still leave the watchdog far behind
    seen: dict[str, object] = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sdist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(sdist.dist, "init_process_group", lambda **kw: seen.update(kw))
    store = object()  # the job's store (this attempt's namespace of the launcher's) is not what is tested here
    monkeypatch.setattr(sdist, "_job_store", lambda info, timeout: store)
    monkeypatch.setattr(sdist.dist.distributed_c10d, "_get_default_store", lambda: None)
    monkeypatch.setattr(sdist.peers, "attach", lambda *a: None)
    sdist.init(timeout_s=120, device="cpu")
    assert seen["backend"] == "gloo" and seen["store"] is store
    assert (
        seen["timeout"]
        == datetime.timedelta(seconds=sdist.process_group_timeout_s(120))
        > datetime.timedelta(seconds=120)
    )


def test_gqa_attention_passes_shared_kv_heads_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn.functional as F

    from sysx.model import layers

    if not layers.SDPA_GQA:
        pytest.skip("this torch's scaled_dot_product_attention has no enable_gqa (torch < 2.5)")
    shapes: list[tuple[int, int, bool]] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        shapes.append((q.shape[1], k.shape[1], kw.get("enable_gqa", False)))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    block = make_layer(TINY, 1)
    init_layer(block, 1)
    block(torch.randn(1, 8, TINY.dim))
    assert shapes == [(TINY.n_heads, TINY.n_kv_heads, True)]


# ------------------------------------------------------------------------------------- low
def test_closing_the_stage_params_synchronises_the_device_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from sysx.runtime.stage_params import StageParams

    order: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append("sync"))
    fake = type("F", (), {})()
    fake.masters, fake.shared, fake.spread_landing = {1: torch.zeros(1)}, {}, {}
    fake.store = type("S", (), {"close": lambda self: order.append("unmap")})()
    StageParams.close(fake)
    assert order == ["sync", "unmap"]


# ------------------------------------------------------------------------------ check script
@pytest.mark.timeout(900)
def test_gpu_check_runs_reduced_on_cpu_and_says_what_it_skipped(tmp_path: Path) -> None:
    out = subprocess.run(
        ["bash", str(ROOT / "profiling" / "gpu_check.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "OUT": str(tmp_path),
            "GPU_CHECK_PYTEST_ARGS": "--co",
            "PYTHON": sys.executable,
        },  # CI runs the venv's python without activating it
        timeout=850,
    )
    log = (tmp_path / "gpu_check.log").read_text()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SKIP (no CUDA)" in log and "losses cpu" in log and "gpu_check: done" in log


def test_the_parameter_pool_is_ordered_before_its_first_load() -> None:
    """CPU twin of the CUDA sanitizer's report on the first GPU run (gpipe on an H200): the pool is
    allocated on the current stream and first written by the h2d stream, which must wait for it."""
    from sysx import device as dev
    from sysx.runtime.buffers import ParamPool

    waited: list[dev.Stream] = []

    class Recording(dev.Stream):
        def wait_stream(self, other: dev.Stream) -> None:
            waited.append(other)

    h2d = Recording(torch.device("cpu"))
    ParamPool(
        16, torch.float32, torch.device("cpu"), layer_numels=[8], h2d=h2d, compute=dev.Stream(torch.device("cpu"))
    )
    assert len(waited) == 1


def test_gpu_check_prints_the_sanitizer_s_report_not_just_its_first_line() -> None:
    """A failed CUDA child prints the report's stacks (the second H200 lease got one line that
    named no tensor or op, and no device time was left to run it again)."""
    sys.path.insert(0, str(ROOT / "profiling"))
    try:
        from gpu_check import sanitizer_report
    finally:
        sys.path.remove(str(ROOT / "profiling"))
    stderr = [
        "step 0",
        "torch.cuda._sanitizer.CUDASanitizerErrors: detected 1 errors",
        "CSAN detected a possible data race on tensor with data pointer 1234",
        "Access by stream 7 during kernel:",
        "aten::zero_",
        "Previous access by stream 9 during kernel:",
        "aten::copy_",
    ]
    assert sanitizer_report(stderr) == stderr[2:]
    assert sanitizer_report(stderr, limit=2) == stderr[2:4]
    assert sanitizer_report(["RuntimeError: boom"]) == []
