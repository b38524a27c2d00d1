"""sysx.autotune: profile cache, profiled costs = simulate, the search keeps the global batch, and
an impossible budget answers with the closest candidate and a checked change. No outcome here
depends on this machine's speed: the profiles are synthetic except where the cache test measures
(and then only the call count is checked)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sysx.autotune import apply as apply_mod
from sysx.autotune import cache as cache_mod
from sysx.autotune import profile as prof
from sysx.autotune.advice import advise
from sysx.autotune.apply import choice, job_from_config, tuned_job_config
from sysx.autotune.cli import main as tune_main
from sysx.autotune.contention import Together, slowdown
from sysx.autotune.costs import profiled_costs
from sysx.autotune.profile import LayerTiming, MachineProfile
from sysx.autotune.report import why
from sysx.autotune.search import TIE, TIE_MEASURED, Budget, Job, Space, divisors, search, thread_options, tie
from sysx.config import ConfigError, load_config, to_yaml
from sysx.dist import DistInfo
from sysx.machine import hardware, hardware_cache
from sysx.machine.hardware import HardwareProfile
from sysx.model import get_preset
from sysx.partition import uniform_partition
from sysx.runtime.options import PipelineOptions, make_schedule
from sysx.schedule.costs import Costs
from sysx.schedule.gpipe import build_gpipe
from sysx.schedule.simulate import simulate

GiB = float(1 << 30)
TINY = get_preset("tiny")
SEQ = 64


def synthetic_profile(cfg=TINY, seq_len: int = SEQ, sizes=(1, 2, 4, 8)) -> MachineProfile:
    """A profile with made-up, size-proportional times (block 1 ms per 64 tokens, backward 3x)."""
    hw = HardwareProfile(
        name="synthetic",
        kind="cpu",
        h2d_bytes_per_s=10e9,
        d2h_bytes_per_s=10e9,
        bidir_bytes_per_s=8e9,
        matmul_flops_per_s=1e12,
        device_mem_bytes_per_s=100e9,
        device_free_bytes=int(8 * GiB),
        device_total_bytes=int(8 * GiB),
        host_free_bytes=int(32 * GiB),
        host_total_bytes=int(32 * GiB),
        measured=False,
    )
    per_token = {"embedding": 1e-7, "block": 1e-3 / 64, "head": 3e-3 / 64}
    layers = {
        k: [LayerTiming(m * seq_len, t * m * seq_len, 3 * t * m * seq_len) for m in sizes] for k, t in per_token.items()
    }
    return MachineProfile(
        machine={"host": "test"},
        shape=prof.shape_key(cfg, seq_len, torch.float32),
        hardware=hw,
        layers=layers,
        adam_params_per_s=5e8,
        cpu_threads=8,
        host_available=int(32 * GiB),
        shm_free=int(16 * GiB),
        shm_total=int(16 * GiB),
    )


ROOMY = Budget(gpu=8 * GiB, host=32 * GiB, shm=16 * GiB)
# the budget tests search and re-search (advice): a smaller space keeps them fast
SMALL = Space(cfgs=(0, 3), param_buffers=(1, 2))


def test_profile_json_round_trip_and_interpolation() -> None:
    p = synthetic_profile()
    q = MachineProfile.from_json(p.to_json())
    assert q == p
    f1, b1 = p.layer_time("block", 64)
    f3, _ = p.layer_time("block", 192)  # between the measured 128 and 256 tokens
    assert f1 == pytest.approx(1e-3) and b1 == pytest.approx(3e-3)
    assert f3 == pytest.approx(3e-3)
    assert p.layer_time("head", 1024)[0] == pytest.approx(2 * p.layer_time("head", 512)[0])  # beyond: proportional


def test_slowdown_measured_together_scales_layer_and_host_costs() -> None:
    """The ranks' mean Block time measured together over the profile's is the factor every layer and
    the per-op host cost are charged (their uneven pace is the meeting's); never below 1 (the profile
    is the fastest the layer ran)."""
    p = synthetic_profile()  # block: 1 ms forward + 3 ms backward at 64 tokens
    assert slowdown(p, SEQ, [8e-3, 16e-3]) == pytest.approx(3.0)
    assert slowdown(p, SEQ, [1e-3]) == 1.0
    with pytest.raises(ValueError):
        slowdown(p, SEQ, [])
    alone = profiled_costs(p, TINY, SEQ, 2, gpus_per_node=2)
    hw = dataclasses.replace(p.hardware, op_host_s=5e-6)
    shared = profiled_costs(dataclasses.replace(p, hardware=hw, slowdown=3.0), TINY, SEQ, 2, gpus_per_node=2)
    assert shared.layer_fwd_time == pytest.approx(tuple(3 * t for t in alone.layer_fwd_time))
    assert shared.op_host == pytest.approx(15e-6)
    assert MachineProfile.from_json(dataclasses.replace(p, slowdown=3.0).to_json()).slowdown == 3.0


def test_the_meeting_measured_together_is_charged_once_a_step_at_validate() -> None:
    """The ranks' measured meeting is the step end VALIDATE charges, once a step, in place of the
    modelled all-reduces (its rounds end with the step end's collectives): the planned iteration
    grows by the difference; kept through the profile's JSON."""
    p = synthetic_profile()
    sched = build_gpipe(2, 2, uniform_partition(2, 1, (TINY.n_layers + 2) // 2))
    for world in (None, 2):  # the default latency, and the step's all-reduces at the measured p2p latency
        plain = profiled_costs(p, TINY, SEQ, 2, gpus_per_node=2, world=world)
        met = profiled_costs(dataclasses.replace(p, meeting_s=0.25), TINY, SEQ, 2, gpus_per_node=2, world=world)
        assert met.allreduce_latency == pytest.approx(0.25) and plain.allreduce_latency < 0.01
        grown = simulate(sched, met, record=False).iteration - simulate(sched, plain, record=False).iteration
        assert grown == pytest.approx(0.25 - plain.allreduce_latency)
    assert MachineProfile.from_json(dataclasses.replace(p, meeting_s=0.25).to_json()).meeting_s == 0.25


def test_profiled_costs_are_what_simulate_gets() -> None:
    """The cost model is simulate on Costs: same iteration and memory as Costs built by hand from the profile."""
    p = synthetic_profile()
    mbs = 2
    costs = profiled_costs(p, TINY, SEQ, mbs, work_dtype="float32", optim_workers=2, threads_per_worker=3)
    fwd = [p.layer_time(k, mbs * SEQ)[0] for k in ["embedding"] + ["block"] * TINY.n_layers + ["head"]]
    assert costs.layer_fwd_time == pytest.approx(tuple(fwd))
    assert costs.bwd_ratio == pytest.approx(2.0)  # backward with recompute is 3x forward: 1 + ratio
    assert costs.optim_params_per_s == pytest.approx(3 * 5e8)
    # a measured job rate (load and check, step, write) is what a job is charged, not Adam's alone
    jobs = profiled_costs(dataclasses.replace(p, optim_job_params_per_s=2e8), TINY, SEQ, mbs, threads_per_worker=3)
    assert jobs.optim_params_per_s == pytest.approx(3 * 2e8)
    sched = make_schedule(PipelineOptions(stages_per_rank=2, split=1), TINY, n_ranks=2, n_micro=4, seq_len=SEQ)
    hand = Costs(
        layer_fwd_time=tuple(fwd),
        layer_params=costs.layer_params,
        act_bytes=mbs * SEQ * TINY.dim * 4,
        layer_act_bytes=costs.layer_act_bytes,
        input_bytes=mbs * SEQ * 8,
        bwd_ratio=2.0,
        param_bytes=4,
        grad_bytes=4,
        host_bytes_per_param=costs.host_bytes_per_param,
        h2d_bandwidth=10e9,
        d2h_bandwidth=10e9,
        optim_params_per_s=1.5e9,
        optim_workers=2,
        posted_sends=True,
    )  # the runtime's isends
    a, b = simulate(sched, costs), simulate(sched, hand)
    assert a.iteration == pytest.approx(b.iteration) and a.iteration > 0
    assert a.peak_gpu == pytest.approx(b.peak_gpu) and a.host == pytest.approx(b.host) and a.shm == pytest.approx(b.shm)
    # and the search's candidate is that simulation
    res = search(
        Job(TINY, SEQ, 8, 2, work_dtype="float32", optim_backend="torch"),
        ROOMY,
        p,
        Space(
            stages_per_rank=(2,),
            block_stages=False,
            splits=(1,),
            cfgs=(3,),
            param_buffers=(2,),
            micro_batch_sizes=(2,),
            optimizer_workers=(2,),
        ),
    )
    (cand,) = res.fitting
    assert cand.threads_per_worker == 2  # 8 cores over 2 ranks, 2 torch-backend workers each
    c = simulate(sched, profiled_costs(p, TINY, SEQ, mbs, work_dtype="float32", optim_workers=2, threads_per_worker=2))
    assert cand.iteration == pytest.approx(c.iteration) and cand.gpu == pytest.approx(max(c.peak_gpu))


@pytest.mark.parametrize("schedule,ranks,batch", [("sysx", 2, 12), ("sysx", 3, 8), ("1f1b", 2, 8), ("mobius", 2, 6)])
def test_search_never_changes_the_global_batch(schedule: str, ranks: int, batch: int) -> None:
    res = search(Job(TINY, SEQ, batch, ranks, schedule=schedule), ROOMY, synthetic_profile())
    cands = res.fitting + res.rejected
    assert res.fitting, res.invalid[:3]
    assert all(c.global_batch == batch for c in cands)
    assert {c.micro_batch_size for c in cands} <= set(divisors(batch))
    assert len({c.micro_batch_size for c in cands}) > 1  # the split of the batch is really searched
    times = [c.iteration for c in res.fitting]
    limit = min(times) * (1 + TIE)  # near-equal times go to the fewest instructions; the rest by time
    near = sum(t <= limit for t in times)
    assert all(t <= limit for t in times[:near]) and times[near:] == sorted(times[near:])


def test_near_equal_predictions_go_to_the_fewest_instructions() -> None:
    """Within TIE (1%) of the fastest the model cannot tell candidates apart (each instruction costs
    the host more than it charges): the fewest instructions per step go first; beyond it, the
    ranking by time stands; on a measured machine the band is TIE_MEASURED (3%). The search fills in
    every candidate's instruction count."""
    from sysx.autotune.search import fewest_instructions_first

    def cand(iteration: float, instructions: int) -> Any:
        return SimpleNamespace(iteration=iteration, instructions=instructions)

    a, b, c, d = cand(1.000, 90), cand(1.004, 30), cand(1.009, 30), cand(1.02, 5)
    assert TIE == 0.01 and TIE_MEASURED == 0.03
    assert fewest_instructions_first([a, b, c, d]) == [b, c, a, d]  # b before c: as ranked at equal counts
    assert fewest_instructions_first([a, b, c, d], TIE_MEASURED) == [d, b, c, a]
    assert fewest_instructions_first([]) == []
    assumed = synthetic_profile()
    measured = dataclasses.replace(assumed, hardware=dataclasses.replace(assumed.hardware, measured=True))
    assert tie(assumed) == TIE and tie(measured) == TIE_MEASURED
    # the first job's fastest are 1% apart in many instruction counts; the second's fewest within 3%
    # (174 a step) are 2.5% from its fastest (254)
    jobs = (job_from_config(_job_config(), 2, 2, torch.device("cpu")), Job(TINY, SEQ, 8, 2))
    for job, profile in itertools.product(jobs, (assumed, measured)):
        result = search(job, ROOMY, profile)
        ranked = result.fitting
        assert all(x.instructions > 0 for x in ranked)
        fastest = min(ranked, key=lambda x: x.iteration)
        near = [x for x in ranked if x.iteration <= fastest.iteration * (1 + tie(profile))]
        assert ranked[0].instructions == min(x.instructions for x in near)
        # the report says what a winner slower in plan was preferred to
        said = [line for line in why(result, None) if line.startswith("preferred to")]
        if ranked[0].iteration > fastest.iteration:
            assert said == [said[0]] and f"`{fastest.label()}` ({fastest.iteration:.4g} s" in said[0]
            assert f"({ranked[0].instructions} against {fastest.instructions})" in said[0]
        else:
            assert said == []
    assert any(line.startswith("preferred to") for line in why(result, None))
    assert result.fitting[0].instructions < search(job, ROOMY, assumed).fitting[0].instructions


def test_nvme_tier_charges_the_exposed_io_and_counts_the_state_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """optim.offload=nvme: each candidate's iteration gains the disk time it cannot hide (12 bytes per
    parameter read and written at 1 MB/s on the one node), and the state files meet the disk budget.
    The tier keeps the last optimizer step on its owner; the host-memory run it is compared with too."""
    from sysx.optim.nvme.cost import DiskRates
    from sysx.runtime import PipelineOptions
    from sysx.schedule.costs import model_layer_params

    slow = DiskRates(1e6, 1e6)
    with monkeypatch.context() as m:
        m.setattr(PipelineOptions, "spreads", lambda self, allowed=True: False)
        plain = search(Job(TINY, SEQ, 8, 2), ROOMY, synthetic_profile(), SMALL)
    tier = search(Job(TINY, SEQ, 8, 2, offload="nvme", disk=slow), ROOMY, synthetic_profile(), SMALL)
    io_s = 2 * 12 * sum(model_layer_params(TINY)) / 1e6
    before = {c.label(): c.iteration for c in plain.fitting}
    assert tier.fitting and len(tier.fitting) == len(plain.fitting)
    for c in tier.fitting:
        assert c.exposed_io == pytest.approx(io_s - before[c.label()])
        assert c.iteration == pytest.approx(io_s)  # the disk is the step
    full = search(
        Job(TINY, SEQ, 8, 2, offload="nvme", disk=slow),
        dataclasses.replace(ROOMY, disk=1e6),
        synthetic_profile(),
        SMALL,
    )
    assert full.best is None and all(
        c.over["disk"] == pytest.approx(12 * sum(model_layer_params(TINY)) / 1e6) for c in full.rejected
    )


def test_over_budget_candidates_are_rejected_before_running() -> None:
    p = synthetic_profile()
    job = Job(TINY, SEQ, 8, 2)
    roomy = search(job, ROOMY, p, SMALL)
    gpu_needs = sorted(c.gpu for c in roomy.fitting)
    cut = gpu_needs[len(gpu_needs) // 2]
    tight = search(job, dataclasses.replace(ROOMY, gpu=cut), p, SMALL)
    assert tight.fitting and tight.rejected
    assert all(c.gpu <= cut for c in tight.fitting) and all(c.gpu > cut for c in tight.rejected)


def test_impossible_gpu_budget_gives_the_closest_candidate_and_the_memory_it_needs() -> None:
    p = synthetic_profile()
    job = Job(TINY, SEQ, 8, 2)
    roomy = search(job, ROOMY, p, SMALL)
    needs = sorted(c.gpu for c in roomy.fitting)
    assert needs[0] < needs[-1]  # the layouts differ in GPU memory, so "closest" means something
    budget = dataclasses.replace(ROOMY, gpu=needs[0] * 0.6)
    res = search(job, budget, p, SMALL)
    assert res.best is None and len(res.rejected) == len(roomy.fitting)
    closest = res.closest
    assert closest is not None and closest.gpu == pytest.approx(needs[0])
    assert closest.worst == min(c.worst for c in res.rejected)
    gpu = {ch.kind: ch for ch in advise(res, p, SMALL, rank_factors=(), min_seq=SEQ)}["gpu"]
    assert gpu.value == pytest.approx(needs[0]) and "GPU memory" in gpu.text
    assert search(job, dataclasses.replace(budget, gpu=gpu.value), p, SMALL).best is not None  # the change is enough


def test_impossible_host_budget_proposes_more_host_memory_or_more_ranks() -> None:
    p = synthetic_profile()
    job = Job(TINY, SEQ, 8, 2)
    least_host = min(c.host for c in search(job, ROOMY, p, SMALL).fitting)
    budget = dataclasses.replace(ROOMY, host=least_host * 0.6)  # no candidate's host memory fits
    res = search(job, budget, p, SMALL)
    assert res.best is None
    closest = res.closest
    assert closest is not None and closest.over["host"] == pytest.approx(least_host / budget.host)
    changes = advise(res, p, SMALL)
    kinds = {ch.kind: ch for ch in changes}
    assert kinds["host"].value == pytest.approx(least_host)  # exactly what the closest needs
    assert search(job, dataclasses.replace(budget, host=kinds["host"].value), p, SMALL).best is not None
    # more ranks (more nodes, each holding less optimizer state) is checked by a search that fits
    assert kinds["ranks"].value in (4, 8, 16)
    bigger = dataclasses.replace(job, n_ranks=int(kinds["ranks"].value), gpus_per_node=2)
    assert search(bigger, budget, p, SMALL).best is not None
    assert all(ch.text for ch in changes)


def test_shorter_sequences_are_proposed_when_activations_do_not_fit() -> None:
    cfg = dataclasses.replace(TINY, max_seq_len=4096)
    p = synthetic_profile(cfg, seq_len=2048, sizes=(1, 2))
    job = Job(cfg, 2048, 2, 2)
    need = min(c.gpu for c in search(job, ROOMY, p, SMALL).fitting)
    res = search(job, dataclasses.replace(ROOMY, gpu=need * 0.5), p, SMALL)
    assert res.best is None
    seq = {ch.kind: ch for ch in advise(res, p, SMALL, rank_factors=())}["seq_len"]
    assert seq.value < 2048
    assert search(
        dataclasses.replace(job, seq_len=int(seq.value)), dataclasses.replace(ROOMY, gpu=need * 0.5), p, SMALL
    ).best


def test_a_cpu_profile_times_each_pass_as_a_windowed_mean_in_rounds_over_every_layer(monkeypatch) -> None:
    """A run pays a pass's typical time, and a shared CPU drifts: each pass is the mean of its
    windows, one window a round, and each round visits every layer kind and size (issue 27)."""
    calls: list[dict[str, Any]] = []

    def window(step, *, repeats, window_s):
        calls.append({"repeats": repeats, "window_s": window_s})
        return float(len(calls)), 0.0  # the n-th window of the profile reads n seconds

    monkeypatch.setattr(hardware, "mean_run_seconds", window)
    small = dataclasses.replace(TINY, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=2, max_seq_len=64)
    layers = prof._time_layers(small, [2, 1], 16, torch.device("cpu"), torch.float32, repeats=3)
    points = [(kind, mbs) for kind in prof.LAYER_KINDS for mbs in (1, 2)]
    assert len(calls) == 3 * 2 * len(points)  # a forward and a backward window per point and round
    assert all(c == {"repeats": 1, "window_s": prof.WINDOW_S} for c in calls)
    per_round = 2 * len(points)
    for i, (kind, mbs) in enumerate(points):
        timing = layers[kind][(1, 2).index(mbs)]
        assert timing.tokens == mbs * 16
        # the point's forward is window 2i+1 of each round, its backward the next
        assert timing.fwd_s == pytest.approx(sum(r * per_round + 2 * i + 1 for r in range(3)) / 3)
        assert timing.bwd_s == pytest.approx(sum(r * per_round + 2 * i + 2 for r in range(3)) / 3)


def test_profile_cache_is_reused_and_invalidated_by_the_shape(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SYSX_CACHE_DIR", str(tmp_path))
    calls: list[tuple[int, int]] = []
    real = prof.measure_profile

    def counting(cfg, seq_len, sizes, **kw):
        calls.append((cfg.dim, seq_len))
        timed_with.append(torch.get_num_threads())
        return real(cfg, seq_len, sizes, repeats=1, adam_backend="torch", **kw)

    timed_with: list[int] = []

    monkeypatch.setattr(prof, "measure_profile", counting)
    monkeypatch.setattr(hardware_cache, "measure_process_bytes", lambda: 1 << 20)  # a fresh interpreter: seconds
    probed: list[list[int]] = []  # the token counts, then the Blocks
    monkeypatch.setattr(  # two interpreters: seconds
        prof,
        "measure_backward_bytes",
        lambda cfg, seq, tokens, dtype, blocks: probed.append([*tokens, blocks]) or {16: (1 << 10, 1 << 11)},
    )
    small = dataclasses.replace(TINY, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=2, max_seq_len=64)
    first, reused = cache_mod.load_or_measure(small, 16, [1, 4, 2], device="cpu")
    assert probed == [[16, 32, 64, 4]]  # every micro-batch's tokens, four Blocks against one (a small model)
    assert first.backward_bytes == [[16, 1 << 10, 1 << 11]]  # a CPU profile keeps what the backward holds
    assert not reused and len(calls) == 1
    again, reused = cache_mod.load_or_measure(small, 16, [2], device="cpu")
    assert reused and len(calls) == 1 and again == first
    assert (
        json.loads(cache_mod.profile_path(small, 16, torch.float32, torch.device("cpu")).read_text())["shape"]["dim"]
        == 32
    )
    wider = dataclasses.replace(small, ffn_dim=96)  # a changed shape: measured again
    _, reused = cache_mod.load_or_measure(wider, 16, [1], device="cpu")
    assert not reused and len(calls) == 2
    _, reused = cache_mod.load_or_measure(small, 32, [1], device="cpu")  # another sequence length too
    assert not reused and len(calls) == 3
    _, reused = cache_mod.load_or_measure(small, 16, [8], device="cpu")  # a micro-batch size never timed
    assert not reused and len(calls) == 4
    # the ranks' threads: a profile timed with 1 thread does not answer for ranks that compute with 2,
    # and each is timed with its own count (the caller's is back afterwards)
    before = torch.get_num_threads()
    one, reused = cache_mod.load_or_measure(small, 16, [1], device="cpu", threads=1)
    assert not reused and timed_with[-1] == 1
    _, reused = cache_mod.load_or_measure(small, 16, [1], device="cpu", threads=2)
    assert not reused and timed_with[-1] == 2 and len(calls) == 6
    again, reused = cache_mod.load_or_measure(small, 16, [1], device="cpu", threads=1)
    assert reused and again == one and torch.get_num_threads() == before
    assert all(len(v) >= 1 for v in first.layers.values()) and first.adam_params_per_s > 0
    assert first.optim_job_params_per_s is not None and first.optim_job_params_per_s > 0


def test_optimizer_threads_follow_the_core_plan() -> None:
    p = synthetic_profile()  # 8 physical cores
    torch_job, ds_job = Job(TINY, SEQ, 8, 2, optim_backend="torch"), Job(TINY, SEQ, 8, 2, optim_backend="deepspeed")
    assert thread_options(torch_job, p, Space()) == [(1, 4), (2, 2), (4, 1)]
    assert thread_options(ds_job, p, Space()) == [(1, 4)]  # one DeepSpeed worker holds the GIL: more would not overlap


def _tune(monkeypatch, tmp_path, capsys, *extra: str) -> dict:
    monkeypatch.setenv("SYSX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prof, "measure_profile", lambda cfg, seq_len, sizes, **kw: synthetic_profile(cfg, seq_len))
    assert (
        tune_main(
            [
                "--ranks",
                "2",
                "--json",
                *extra,
                "--hydra",
                "model=tiny",
                f"train.seq_len={SEQ}",
                "train.micro_batch_size=2",
                "train.micro_batches=4",
                "device=cpu",
            ]
        )
        == 0
    )
    return json.loads(capsys.readouterr().out)


def test_sysx_tune_json_keeps_the_batch_and_explains(monkeypatch, tmp_path, capsys) -> None:
    out = _tune(monkeypatch, tmp_path, capsys, "--gpu-memory-gib", "8", "--host-memory-gib", "32", "--shm-gib", "16")
    assert out["top"] and all(c["global_batch"] == 8 and c["fits"] for c in out["top"])
    assert out["top"][0]["iteration_s"] <= out["top"][-1]["iteration_s"]
    base = out["baseline"]  # the fixed rule: 2 stages/rank with d=2 cannot cut 6 layers, 1 stage/rank with d=2 can
    assert (base["micro_batch_size"], base["stages_per_rank"], base["split"]) == (2, 1, 2)
    assert out["why"][1].startswith("winner") and out["closest"] is None and not out["changes"]
    # the job's global batch, and the winner's split when the search chose replicas (2 ranks: 1 or 2)
    win = out["top"][0]
    split = f" (the winner's: 2 replicas x {win['micro_batch_size'] * win['micro_batches']} sequences)"
    assert out["why"][0].endswith(
        "; global batch 8 sequences in every candidate" + (split if win["replicas"] == 2 else "")
    )
    # speed-ups are ratios of iteration times (0.431 s against 2.063 s is 4.79x, not "79.1% faster")
    ratio = base["iteration_s"] / out["top"][0]["iteration_s"]
    assert any(line.endswith(f"the winner is {ratio:.3g}x faster") for line in out["why"]), out["why"]
    assert not any("% faster" in line for line in out["why"])
    assert not out["profile_reused"]
    assert _tune(monkeypatch, tmp_path, capsys)["profile_reused"]


def test_sysx_tune_with_no_room_names_the_closest_and_the_change(monkeypatch, tmp_path, capsys) -> None:
    out = _tune(monkeypatch, tmp_path, capsys, "--host-memory-gib", "0.001")
    assert not out["top"] and out["closest"]["global_batch"] == 8
    assert out["closest"]["over"]["host"] > 1 and any(c["kind"] == "host" for c in out["changes"])
    assert any(line.startswith("nothing fits; closest") for line in out["why"])


def _job_config(*extra: str):
    return load_config(
        [
            "schedule=sysx",
            "schedule.tune=true",
            "model=tiny",
            f"train.seq_len={SEQ}",
            "train.micro_batch_size=2",
            "train.micro_batches=4",
            "device=cpu",
            *extra,
        ]
    )


def test_schedule_tune_at_job_start_writes_the_choice_into_the_config(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SYSX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prof, "measure_profile", lambda cfg, seq_len, sizes, **kw: synthetic_profile(cfg, seq_len))
    # the Block timed with every rank computing: 3x the profile's 1 + 3 ms (no speed of this machine enters)
    monkeypatch.setattr(apply_mod, "time_block_together", lambda *a, **kw: Together(12e-3, 12e-3, []))
    cfg = _job_config()
    tuned = tuned_job_config(cfg, DistInfo(), torch.device("cpu"))
    assert tuned.train.micro_batch_size * tuned.train.micro_batches == 8  # the global batch is the config's
    job = job_from_config(cfg, 1, None, torch.device("cpu"))
    best = search(job, ROOMY, dataclasses.replace(synthetic_profile(), slowdown=3.0)).best
    assert best is not None
    for key, value in choice(best).items():
        section, name = key.split(".")
        assert getattr(getattr(tuned, section), name) == value, key
    assert f"stages_per_rank: {best.options.stages_per_rank}" in to_yaml(tuned)  # what run_dir/config.yaml gets


def test_schedule_tune_with_no_room_stops_with_the_closest_and_the_change(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SYSX_CACHE_DIR", str(tmp_path))
    small = dataclasses.replace(synthetic_profile(), host_available=1 << 16)
    monkeypatch.setattr(prof, "measure_profile", lambda cfg, seq_len, sizes, **kw: small)
    with pytest.raises(ConfigError, match=r"(?s)closest: schedule=sysx .*change: host memory per node"):
        tuned_job_config(_job_config(), DistInfo(), torch.device("cpu"))


def test_schedule_tune_must_be_a_bool_and_needs_a_pipeline() -> None:
    with pytest.raises(ValueError):
        _job_config("schedule.tune=sometimes")
    with pytest.raises(ConfigError, match="schedule=single runs one process"):
        job_from_config(load_config(["schedule=single"]), 1, None, torch.device("cpu"))


def test_sysx_train_with_schedule_tune_runs_the_choice_and_records_it(monkeypatch, tmp_path, capsys) -> None:
    from sysx.train import main as train_main

    monkeypatch.setenv("SYSX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(prof, "measure_profile", lambda cfg, seq_len, sizes, **kw: synthetic_profile(cfg, seq_len))
    # the ranks' Block timed together says how loaded the machine is; a busy one would move the choice
    # away from the search below over the same profile, so the job sees no contention (slowdown 1)
    monkeypatch.setattr(apply_mod, "time_block_together", lambda *a, **kw: Together(0.0, 0.0, []))
    run_dir = tmp_path / "run"
    assert (
        train_main(
            [
                "schedule=sysx",
                "schedule.tune=true",
                "model=tiny",
                f"train.seq_len={SEQ}",
                "train.steps=1",
                "train.micro_batch_size=2",
                "train.micro_batches=4",
                "device=cpu",
                "eval.every=0",
                "log.progress=false",
                f"run_dir={run_dir}",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    best = search(Job(TINY, SEQ, 8, 1, work_dtype="float32"), ROOMY, synthetic_profile()).best
    assert best is not None and "schedule.tune (profile measured" in out and best.label() in out
    assert "global batch 8 sequences in every candidate" in out
    saved = (run_dir / "config.yaml").read_text()
    assert f"stages_per_rank: {best.options.stages_per_rank}" in saved and f"split: {best.options.split}" in saved
    assert f"micro_batch_size: {best.micro_batch_size}" in saved and "tune: true" in saved


def test_the_rollback_buffers_count_against_the_host_budget() -> None:
    """``optim.rollback=exact`` keeps a second (p, m, v) set: 12 more host bytes per parameter in
    every candidate, so a budget that fits undo's need can refuse exact's."""
    p = synthetic_profile()
    undo = search(Job(TINY, SEQ, 8, 2), ROOMY, p, SMALL)
    exact = search(Job(TINY, SEQ, 8, 2, rollback="exact"), ROOMY, p, SMALL)
    least_undo, least_exact = min(c.host for c in undo.fitting), min(c.host for c in exact.fitting)
    assert least_exact > least_undo
    tight = dataclasses.replace(ROOMY, host=least_undo)
    assert search(Job(TINY, SEQ, 8, 2), tight, p, SMALL).best is not None
    assert search(Job(TINY, SEQ, 8, 2, rollback="exact"), tight, p, SMALL).best is None
