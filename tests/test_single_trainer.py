"""schedule=single end to end: the same losses, gradient norms and parameters as the reference
trainer (fp32, relative difference <= 1e-5) for windows of 1, 2 and more blocks and for every
saved-activation level and policy; the optimizer pipeline modes; the ring order (CPU twin of the
GPU stream checks); and, with CUDA, the peak-memory budget and copy/compute overlap."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sysx import device as dev
from sysx.config import EvalSection, OptimSection, SingleSection, SysxConfig, TrainSection
from sysx.machine.hardware import GiB
from sysx.single.hardware import assumed_hardware
from sysx.trainers.reference import ReferenceTrainer
from sysx.trainers.single import SingleTrainer

STEPS = 3
HW = assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=8)  # planning figures; compute runs on CPU


pytestmark = pytest.mark.usefixtures("one_thread")


def make_cfg(**optim) -> SysxConfig:
    return SysxConfig(
        train=TrainSection(steps=STEPS, micro_batch_size=2, micro_batches=4, seq_len=32),
        optim=OptimSection(**optim),
        eval=EvalSection(every=0, batches=2),
        device="cpu",
    )


_REF: dict[tuple, tuple] = {}


def reference(cfg: SysxConfig) -> tuple[list, dict[str, torch.Tensor]]:
    key = (cfg.precision, cfg.optim.grad_clip)
    if key not in _REF:
        torch.set_num_threads(1)
        trainer = ReferenceTrainer(cfg)
        _REF[key] = (trainer.run(STEPS), trainer.state_dict())
    return _REF[key]


def run_single(
    cfg: SysxConfig, single: SingleSection, *, device: str = "cpu", hardware=HW
) -> tuple[list, dict, SingleTrainer]:
    trainer = SingleTrainer(cfg, single=single, hardware=hardware, optimizer_backend="torch", device=device)
    try:
        results = trainer.run(STEPS)
        state = trainer.state_dict()
    finally:
        trainer.close()
    return results, state, trainer


def diffs(results, state, ref_results, ref_state) -> tuple[float, float, float]:
    """Max relative difference of step losses, of gradient norms, and of parameters (per tensor, vs its max)."""
    loss = max(abs(a.loss - b.loss) / abs(b.loss) for a, b in zip(results, ref_results))
    norm = max(abs(a.grad_norm - b.grad_norm) / abs(b.grad_norm) for a, b in zip(results, ref_results))
    assert set(state) == set(ref_state)
    param = max(float((state[k].cpu() - v).abs().max() / v.abs().max()) for k, v in ref_state.items())
    return loss, norm, param


CASES = [
    # window, policy, sequences per round, chunk
    (1, "input", 4, 2),
    (2, "attention", 8, 2),
    (3, "projections", 2, 2),
    (4, "matmuls", 8, 2),  # every block resident: nothing slides
    (4, "everything", 4, 2),  # nothing slides, 2 rounds: every block keeps its graph
    (2, "everything", 4, 2),
    (2, "dp", 4, 2),
    (1, "pyao", 8, 2),
]


@pytest.mark.parametrize("window,policy,round_sequences,chunk", CASES)
def test_matches_reference_trainer(window: int, policy: str, round_sequences: int, chunk: int) -> None:
    cfg = make_cfg()
    ref_results, ref_state = reference(cfg)
    single = SingleSection(
        window=window, policy=policy, round_sequences=round_sequences, micro_batch_size=chunk, print_plan=False
    )
    results, state, trainer = run_single(cfg, single)
    plan = trainer.plan
    assert (plan.window, plan.round_sequences, plan.chunk) == (window, round_sequences, chunk)
    loss, norm, param = diffs(results, state, ref_results, ref_state)
    assert loss <= 1e-5 and norm <= 1e-5 and param <= 1e-5, (loss, norm, param)
    stats = trainer.executor.stats
    L = cfg_layers(cfg)
    if window < L:
        assert stats.d2h_acts > 0 and stats.h2d_acts == stats.d2h_acts  # what went home came back
        assert stats.weight_loads > L  # weights slide
    else:
        assert stats.d2h_acts == 0
    replay = trainer.executor.replay
    if policy == "input":
        assert replay.reused_sites == 0
    if policy in ("everything",):
        assert replay.recomputed_flops == 0.0
    assert not plan.keep_graph  # single.keep_graph=false by default


def test_kept_graphs_match_capture_and_replay_bit_for_bit(dispatch_mode_calls: dict[str, int]) -> None:
    """A window whose blocks keep their forward's graph trains to the same bits as one that saves
    every site and replays them, over two rounds a step, and runs neither dispatch mode."""
    calls = dispatch_mode_calls
    cfg = make_cfg(grad_clip=1.0)
    runs = {}
    for keep in (True, False):
        single = SingleSection(
            policy="everything", round_sequences=4, micro_batch_size=2, keep_graph=keep, print_plan=False
        )
        results, state, trainer = run_single(cfg, single)
        assert trainer.plan.keep_graph == keep and trainer.plan.window == cfg_layers(cfg) and trainer.plan.rounds == 2
        assert trainer.executor.replay.recomputed_sites == 0
        assert trainer.executor.arena.describe()["activation ring"] == trainer.plan.device_bytes["activation ring"]
        runs[keep] = (results, state, dict(calls))
    (kept, kept_state, kept_calls), (replayed, replayed_state, replayed_calls) = runs[True], runs[False]
    assert kept_calls == {"Capture": 0, "Replay": 0}
    assert replayed_calls["Capture"] > 0 and replayed_calls["Replay"] > 0
    assert [(r.loss, r.grad_norm) for r in kept] == [(r.loss, r.grad_norm) for r in replayed]
    assert all(torch.equal(kept_state[k], replayed_state[k]) for k in replayed_state)


def cfg_layers(cfg: SysxConfig) -> int:
    from sysx.config import model_config

    return model_config(cfg).n_layers


@pytest.mark.parametrize("overlap,clip", [("auto", 0.0), ("backward", 1.0), ("forward", 1.0), ("auto", 1.0)])
def test_optimizer_pipeline_modes_match_reference(overlap: str, clip: float) -> None:
    cfg = make_cfg(grad_clip=clip)
    ref_results, ref_state = reference(cfg)
    single = SingleSection(
        window=2, policy="dp", round_sequences=4, micro_batch_size=2, optimizer_overlap=overlap, print_plan=False
    )
    results, state, trainer = run_single(cfg, single)
    loss, norm, param = diffs(results, state, ref_results, ref_state)
    assert loss <= 1e-5 and norm <= 1e-5 and param <= 1e-5, (loss, norm, param)
    clipped = sum(r.grad_norm > clip for r in ref_results) if clip > 0 else 0
    if clip == 0:
        assert trainer.speculated_steps == STEPS and trainer.redone_steps == 0  # every block stepped during backward
    elif overlap == "backward":
        assert trainer.speculated_steps == STEPS and trainer.redone_steps == clipped
    elif overlap == "forward":
        assert trainer.speculated_steps == 0
    assert clip == 0 or clipped > 0  # the clipping path was exercised


def test_window_takes_optim_rollback_and_refreshes_exact_spares(capsys: pytest.CaptureFixture[str]) -> None:
    """``optim.rollback`` reaches the window's groups (``auto`` resolved against this host and said);
    the decision queues each group's rollback=exact spare refresh behind its decided job: with every
    step clipped, each speculative step undone and stepped again, the run equals a snapshot run bit
    for bit, and no step had to refresh its spare itself (every refresh ran in the background)."""
    import dataclasses

    single = SingleSection(
        window=2, policy="dp", round_sequences=4, micro_batch_size=2, optimizer_overlap="backward", print_plan=False
    )
    runs = {}
    for rollback in ("snapshot", "exact", "auto"):
        cfg = make_cfg(grad_clip=1e-3)
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, rollback=rollback))
        trainer = SingleTrainer(cfg, single=single, hardware=HW, optimizer_backend="torch", device="cpu")
        try:
            results = trainer.run(STEPS)
            state = trainer.state_dict()
            modes = {s.optimizer.rollback for s in trainer.host.stages}
            inline = sum(s.optimizer.inline_refreshes for s in trainer.host.stages)
        finally:
            trainer.close()
        assert modes == ({"exact"} if rollback == "auto" else {rollback})  # a tiny model fits any host
        assert trainer.redone_steps == STEPS  # every step was rolled back and stepped again
        runs[rollback] = ([r.loss for r in results], state, inline)
    assert "optim.rollback=auto -> exact" in capsys.readouterr().out
    (loss_a, state_a, _), (loss_b, state_b, inline) = runs["snapshot"], runs["exact"]
    assert loss_a == loss_b and inline == 0
    assert all(torch.equal(state_a[k].view(torch.int32), state_b[k].view(torch.int32)) for k in state_a)


def test_the_windows_workers_step_with_one_thread_where_the_host_computes() -> None:
    """On a CPU device the optimizer workers keep no OpenMP team beside the compute's
    (:func:`sysx.optim.cores.worker_threads_beside`): the default job ran 1.4-1.8x its plan with one."""
    trainer = SingleTrainer(
        make_cfg(),
        single=SingleSection(window=2, print_plan=False),
        hardware=HW,
        optimizer_backend="torch",
        device="cpu",
    )
    try:
        assert trainer.threads.threads_per_worker == 1
    finally:
        trainer.close()


def test_a_different_split_keeps_the_global_batch() -> None:
    """Chunks of 1 sequence instead of the reference's micro-batches of 2: the same sequences and loss;
    the gradients differ only by summation order, so parameters agree to Adam-amplified rounding."""
    cfg = make_cfg()
    ref_results, ref_state = reference(cfg)
    results, state, trainer = run_single(
        cfg, SingleSection(window=2, micro_batch_size=1, round_sequences=2, print_plan=False)
    )
    assert trainer.plan.micro_batches == 8 and trainer.plan.chunk == 1
    loss, norm, param = diffs(results, state, ref_results, ref_state)
    assert loss <= 1e-6 and norm <= 1e-5 and param <= 1e-4, (loss, norm, param)


def test_evaluation_matches_reference() -> None:
    cfg = make_cfg()
    ref = ReferenceTrainer(cfg)
    trainer = SingleTrainer(
        cfg,
        single=SingleSection(window=1, micro_batch_size=1, round_sequences=2, print_plan=False),
        hardware=HW,
        optimizer_backend="torch",
    )
    try:
        assert trainer.evaluate() == pytest.approx(ref.evaluate(), rel=1e-6)
    finally:
        trainer.close()


def test_bf16_matches_reference_bf16() -> None:
    cfg = make_cfg()
    cfg.precision = "bf16"
    ref_results, ref_state = reference(cfg)
    results, state, _ = run_single(
        cfg, SingleSection(window=2, round_sequences=4, micro_batch_size=2, print_plan=False)
    )
    # before any optimizer step the 16-bit executor is exact: same loss and gradient norm bit for bit
    assert results[0].loss == ref_results[0].loss and results[0].grad_norm == ref_results[0].grad_norm
    # afterwards CpuAdam's fp32 rounding (not torch.optim.AdamW's) flips a few bf16 roundings of the
    # published weights (1 bf16 ulp = 2^-8), which the following steps carry along
    loss, norm, _ = diffs(results, state, ref_results, ref_state)
    assert loss <= 1e-4 and norm <= 1e-3, (loss, norm)
    # the parameters move by only ~0.04% of their size in 3 steps, so compare the updates (measured
    # 1.1%); unmoved parameters (a skipped step) give 1.0, a lost step of three ~0.33
    init = ReferenceTrainer(cfg).state_dict()
    assert update_diff(init, ref_state, init) == 1.0
    assert update_diff(state, ref_state, init) <= 3e-2, update_diff(state, ref_state, init)


def update_diff(state: dict, ref_state: dict, init: dict) -> float:
    """Max over tensors of ``|update - reference update| / |reference update|`` (L2 norms), updates from ``init``."""
    return max(float((state[k].cpu() - v).norm() / (v - init[k]).norm()) for k, v in ref_state.items())


def test_int8_compression_trains_close_and_moves_fewer_bytes() -> None:
    cfg = make_cfg()
    ref_results, _ = reference(cfg)
    base = SingleSection(window=1, policy="matmuls", round_sequences=4, micro_batch_size=2, print_plan=False)
    _, _, plain = run_single(cfg, base)
    packed_results, _, packed = run_single(cfg, SingleSection(**{**base.__dict__, "compress": True}))
    ratio = packed.executor.stats.d2h_acts / plain.executor.stats.d2h_acts
    assert ratio < 0.5
    worst = max(abs(a.loss - b.loss) / b.loss for a, b in zip(packed_results, ref_results))
    assert worst < 5e-3, worst


def test_ring_order_cpu_twin_of_stream_overlap() -> None:
    """The order the executor issues ring operations in is what lets copies overlap compute on a GPU:
    block k+R_param is loaded right after block k releases its slot (before block k+1 computes); the
    last window's activations never leave the device; each block's gradients reach the optimizer
    before the previous block's backward starts."""
    cfg = make_cfg()
    trainer = SingleTrainer(
        cfg,
        single=SingleSection(window=2, policy="dp", round_sequences=8, micro_batch_size=2, print_plan=False),
        hardware=HW,
        optimizer_backend="torch",
    )
    ex = trainer.executor
    ex.trace = []
    for ring in (ex.ring_w, ex.ring_g, ex.ring_a):
        ring.log = ex.trace
    try:
        trainer.train_step()
    finally:
        trainer.close()
    trace = ex.trace
    L, W = ex.L, trainer.plan.window
    pos = {}
    for i, (ring, op, _, key) in enumerate(trace):
        pos.setdefault((ring, op, key), i)
    ver = ex.version
    for k in range(W, L):  # forward prefetch
        fill = pos[("weights", "fill", ("w", k, ver))]
        assert (
            pos[("weights", "release", ("w", k - W, ver))] < fill < pos[("weights", "acquire", ("w", k - W + 1, ver))]
        )
    d2h = [key for ring, op, _, key in trace if op == "d2h_act"]
    assert d2h and all(key[1] < L - W for key in d2h)  # the last window keeps its activations
    fills = [key[1] for ring, op, _, key in trace if ring == "weights" and op == "fill"]
    assert all(fills.count(k) == 1 for k in range(L - W, L))  # the last window stays on the device for backward
    assert all(fills.count(k) == 2 for k in range(L - W))  # the others slide in again during backward
    for k in range(1, L):  # GPU-CPU pipeline: block k's Adam is queued before block k-1's backward
        handed = trace.index(("executor", "optimizer", -1, ("g", k, 0)))
        assert handed < pos[("grads", "acquire", ("g", k - 1, 0))]


def test_working_set_is_preallocated_as_planned() -> None:
    """CPU twin of the GPU budget check: the one device buffer is exactly the planned rings and tables,
    and planned rings + tables + the workspace estimate fit the device budget."""
    cfg = make_cfg()
    budget = 0.004  # 4 MiB: the tiny model's 4 blocks cannot all stay
    trainer = SingleTrainer(
        cfg,
        single=SingleSection(device_memory_gb=budget, print_plan=False),
        hardware=dataclasses.replace(HW, kind="cpu"),
        optimizer_backend="torch",
    )
    try:
        plan, arena = trainer.plan, trainer.executor.arena.describe()
        assert 1 <= plan.window < cfg_layers(cfg)
        assert arena["weight ring"] == plan.device_bytes["weight ring"]
        assert arena["grad ring"] == plan.device_bytes["grad ring"]
        assert arena["activation ring"] <= plan.device_bytes["activation ring"]
        assert plan.device_bytes["total"] <= budget * GiB
        assert trainer.plan.micro_batches * trainer.plan.chunk == 8  # the global batch
    finally:
        trainer.close()


# ------------------------------------------------------------------------------------------- GPU


def _gpu_cfg() -> SysxConfig:
    from sysx.config import ModelSection

    return SysxConfig(
        model=ModelSection(preset="tiny", dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408),
        train=TrainSection(steps=STEPS, micro_batch_size=4, micro_batches=4, seq_len=256),
        eval=EvalSection(every=0),
        device="cuda",
    )


@pytest.mark.gpu
def test_gpu_peak_memory_stays_under_the_budget() -> None:
    cfg = _gpu_cfg()
    budget_gb = 0.4
    trainer = SingleTrainer(
        cfg, single=SingleSection(device_memory_gb=budget_gb, print_plan=True), optimizer_backend="torch"
    )
    try:
        assert trainer.plan.window < 8  # the budget forces the window to slide
        dev.reset_peak_memory(trainer.device)
        trainer.run(STEPS)
        peak = torch.cuda.max_memory_allocated(trainer.device)
    finally:
        trainer.close()
    assert peak <= budget_gb * GiB, f"peak {peak / GiB:.3f} GiB > budget {budget_gb} GiB"


@pytest.mark.gpu
def test_gpu_matches_reference() -> None:
    cfg = make_cfg()
    cfg.device = "cuda"
    cfg.precision = "fp32"  # "auto" is bf16 on a GPU, where chunked and whole-batch kernels differ by ~1e-3
    ref = ReferenceTrainer(cfg)
    ref_results, ref_state = ref.run(STEPS), ref.state_dict()
    results, state, _ = run_single(
        cfg,
        SingleSection(window=2, policy="dp", round_sequences=4, micro_batch_size=2, print_plan=False),
        device="cuda",
        hardware=None,
    )
    loss, norm, param = diffs(results, state, ref_results, {k: v.cpu() for k, v in ref_state.items()})
    assert loss <= 1e-4 and norm <= 1e-4 and param <= 1e-4, (loss, norm, param)


@pytest.mark.gpu
def test_gpu_kept_graphs_match_capture_and_stay_within_the_plan() -> None:
    """CUDA twin of :func:`test_kept_graphs_match_capture_and_replay_bit_for_bit`: the same losses
    and parameters as saving every site (1e-5: CUDA's attention backward may sum in another order),
    and the peak allocated stays within the plan's device bytes."""
    cfg = make_cfg()
    cfg.device = "cuda"
    cfg.precision = "fp32"
    runs = {}
    for keep in (True, False):
        single = SingleSection(
            policy="everything", round_sequences=4, micro_batch_size=2, keep_graph=keep, print_plan=False
        )
        trainer = SingleTrainer(cfg, single=single, optimizer_backend="torch", device="cuda")
        try:
            assert trainer.plan.keep_graph == keep
            dev.reset_peak_memory(trainer.device)
            results = trainer.run(STEPS)
            peak = torch.cuda.max_memory_allocated(trainer.device)
            runs[keep] = (results, trainer.state_dict(), peak, trainer.plan.device_bytes["total"])
        finally:
            trainer.close()
    (kept, kept_state, peak, planned), (replayed, replayed_state, *_) = runs[True], runs[False]
    loss, norm, param = diffs(kept, kept_state, replayed, {k: v.cpu() for k, v in replayed_state.items()})
    assert loss <= 1e-5 and norm <= 1e-5 and param <= 1e-5, (loss, norm, param)
    assert peak <= planned, f"peak {peak} bytes > planned {planned}"


@pytest.mark.gpu
def test_gpu_copies_overlap_compute() -> None:
    """Host->device weight copies run on the inbound stream while kernels run on the compute stream."""
    from torch.profiler import ProfilerActivity, profile

    from sysx.config import ModelSection

    # blocks big enough that their kernels outlast a launch: on an H200 the 512-wide model of the
    # other GPU tests leaves the GPU idle between tiny kernels, so no copy could overlap one
    cfg = dataclasses.replace(
        _gpu_cfg(),
        model=ModelSection(
            preset="tiny", dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=5632, max_seq_len=1024
        ),
        train=TrainSection(steps=STEPS, micro_batch_size=4, micro_batches=2, seq_len=1024),
    )
    trainer = SingleTrainer(
        cfg,
        single=SingleSection(window=2, round_sequences=8, micro_batch_size=4, policy="matmuls", print_plan=False),
        optimizer_backend="torch",
    )
    try:
        trainer.train_step()  # warm up
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            trainer.train_step()
            torch.cuda.synchronize()
    finally:
        trainer.close()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    copies = [e for e in events if "Memcpy HtoD" in e.name]
    kernels = [e for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    assert copies and kernels

    def overlaps(a, b) -> bool:
        return a.time_range.start < b.time_range.end and b.time_range.start < a.time_range.end

    overlapped = sum(any(overlaps(c, k) for k in kernels) for c in copies)
    assert overlapped >= len(copies) // 4, f"only {overlapped} of {len(copies)} copies overlap a kernel"


def test_job_entry_point_trains_and_logs(tmp_path, capsys) -> None:
    """``train(cfg, info)``, what ``sysx-train schedule=single`` dispatches to: plan printed, metrics written."""
    import json

    from sysx.config import ScheduleSection
    from sysx.dist import DistInfo
    from sysx.trainers.single import train

    cfg = make_cfg()
    cfg.schedule = ScheduleSection(name="single")
    cfg.train.steps = 2
    cfg.run_dir = str(tmp_path / "run")
    cfg.log.progress = False
    cfg.optim.backend = "torch"  # what optim.backend will select; avoids building DeepSpeed's op in this test
    assert train(cfg, DistInfo()) == 0
    out = capsys.readouterr().out
    assert "sysx single-GPU plan" in out and "single: W=" in out and "done: 2 steps" in out
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    with pytest.raises(Exception, match="1 process"):
        train(cfg, DistInfo(world_size=2, launcher="torchrun"))


def test_plan_command(capsys) -> None:
    from sysx.single.plan_cmd import main

    assert (
        main(
            [
                "--model",
                "llama2_7b",
                "--seq-len",
                "4096",
                "--global-batch",
                "64",
                "--hardware",
                "rtx4090",
                "--device-gb",
                "24",
                "--host-gb",
                "256",
            ]
        )
        == 0
    )
    assert "window W=" in capsys.readouterr().out
    assert (
        main(
            [
                "--model",
                "llama2_7b",
                "--seq-len",
                "4096",
                "--global-batch",
                "64",
                "--hardware",
                "rtx4090",
                "--device-gb",
                "1.5",
            ]
        )
        == 2
    )
    assert "Raise single.device_memory_gb" in capsys.readouterr().err


def test_window_exact_rollback_speculating_equals_validating_first() -> None:
    """With every step clipped, ``speculate=always`` (each step undone by switching sets and stepped
    again, clipped) ends bit for bit where ``speculate=never`` (one clipped step) does, under
    ``rollback=exact``: no clipped step stays applied unclipped, and the rollback leaves no trace."""
    import dataclasses

    runs = {}
    for speculate in ("always", "never"):
        cfg = make_cfg(grad_clip=1e-3)
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, rollback="exact", speculate=speculate))
        single = SingleSection(window=2, policy="dp", round_sequences=4, micro_batch_size=2, print_plan=False)
        results, state, trainer = run_single(cfg, single)
        assert trainer.redone_steps == (STEPS if speculate == "always" else 0)
        runs[speculate] = ([r.loss for r in results], state)
    (loss_a, state_a), (loss_b, state_b) = runs["always"], runs["never"]
    assert loss_a == loss_b
    assert all(torch.equal(state_a[k].view(torch.int32), state_b[k].view(torch.int32)) for k in state_a)
