"""The single-GPU planner: AdaWS §3.2.2 sizing, §3.2.3 window, hard budgets (too small is refused
with the numbers needed), the global batch never changes, and the printed plan."""

from __future__ import annotations

import math
import re

import pytest
import torch

from sysx.machine.hardware import GiB, measure_hardware
from sysx.model import get_preset
from sysx.single.act_capture import kept_graph_layout
from sysx.single.hardware import assumed_hardware
from sysx.single.plan_costs import meta_profiler
from sysx.single.plan_request import ModelSizes, PlanError, PlanRequest
from sysx.single.planner import make_plan, min_round_sequences
from sysx.single.rings import align

HW24 = assumed_hardware("rtx4090", host_memory_gib=256)
LLAMA7B = get_preset("llama2_7b")
TINY = get_preset("tiny")


def _7b(**kw) -> PlanRequest:
    args = dict(model=LLAMA7B, seq_len=4096, global_batch=64, precision="bf16", grad_clip=1.0)
    args.update(kw)
    return PlanRequest(**args)


def test_7b_on_a_24_gib_gpu_slides_a_window_within_the_budget() -> None:
    plan = make_plan(_7b(), HW24)
    text = plan.render()
    print(text)
    assert plan.device_bytes["total"] <= 24 * GiB
    assert 2 <= plan.window < LLAMA7B.n_layers
    assert plan.r_act == plan.window * plan.chunks and plan.r_param == plan.window
    assert len(plan.levels) == LLAMA7B.n_layers
    assert plan.round_sequences * plan.rounds == 64
    for needle in ("AdaWS 3.2.2", "W = (C_dev - B) / L_bytes", "saved activations", "optimizer", "host memory"):
        assert needle in text
    assert plan.feasible_no_stall


def test_round_size_follows_adaws_formula() -> None:
    req = _7b()
    sizes = ModelSizes.of(LLAMA7B)
    x_min = min_round_sequences(req, sizes, HW24)
    d_attn = LLAMA7B.n_heads * LLAMA7B.head_dim
    by_hand = (
        (2 + 2)
        * sizes.block_params
        * HW24.matmul_flops_per_s
        / (2 * 4096 * (sizes.block_active + 4096 * d_attn) * HW24.link_bytes_per_s)
    )
    assert x_min == pytest.approx(by_hand)
    plan = make_plan(req, HW24)
    divisors = [d for d in range(1, 65) if 64 % d == 0]
    assert plan.round_sequences == min(d for d in divisors if d >= x_min)
    # a slower link needs more sequences per round to hide the transfers
    slow = assumed_hardware("rtx4090", link_gbps=6, bidir_gbps=6, host_memory_gib=256)
    assert make_plan(req, slow).round_sequences > plan.round_sequences


def test_window_follows_adaws_formula() -> None:
    plan = make_plan(_7b(), HW24)
    tau = 2
    static = (
        plan.device_bytes["total"]
        - plan.device_bytes["weight ring"]
        - plan.device_bytes["grad ring"]
        - plan.device_bytes["activation ring"]
    )
    per_block = 2 * align(plan.sizes.block_params * tau) + plan.chunks * align(plan.table.slot_bytes[plan.slot_level])
    assert plan.window == min(LLAMA7B.n_layers, (24 * GiB - static) // per_block)


@pytest.mark.parametrize("gib", [4, 6, 8, 16, 40, 80])
def test_global_batch_never_changes_and_budget_holds(gib: float) -> None:
    plan = make_plan(_7b(device_budget_bytes=int(gib * GiB)), HW24)
    assert plan.chunk * plan.chunks * plan.rounds == 64
    assert plan.micro_batches * plan.chunk == 64
    assert plan.device_bytes["total"] <= gib * GiB


def test_more_device_memory_never_hurts() -> None:
    budgets = (6, 8, 12, 16, 24, 40)
    # with a fixed activation slot size the window only grows ...
    windows = [
        make_plan(_7b(device_budget_bytes=int(g * GiB), round_sequences=2, policy="matmuls"), HW24).window
        for g in budgets
    ]
    assert windows == sorted(windows) and windows[-1] > windows[0]
    # ... and with the DP (which may trade window for bigger slots) the predicted step never gets slower
    steps = [make_plan(_7b(device_budget_bytes=int(g * GiB), round_sequences=2), HW24).times["step_s"] for g in budgets]
    assert all(b <= a * 1.000001 for a, b in zip(steps, steps[1:]))


def test_too_small_device_budget_is_refused_with_the_numbers_needed() -> None:
    with pytest.raises(PlanError) as info:
        make_plan(_7b(device_budget_bytes=2 * GiB), HW24)
    msg = str(info.value)
    assert "single.device_memory_gb" in msg and "needs" in msg and "per block" in msg
    match = re.search(r"Raise single.device_memory_gb to >= ([0-9.]+) \(>= ([0-9.]+) to overlap\)", msg)
    need, need_overlap = float(match.group(1)), float(match.group(2))
    assert 2 < need < need_overlap
    assert make_plan(_7b(device_budget_bytes=int(need * GiB)), HW24).window >= 1  # the numbers given are enough
    assert make_plan(_7b(device_budget_bytes=int(need_overlap * GiB)), HW24).window >= 2


def test_too_small_host_budget_is_refused_with_the_numbers_needed() -> None:
    with pytest.raises(PlanError) as info:
        make_plan(_7b(host_budget_bytes=64 * GiB), HW24)
    msg = str(info.value)
    assert "host budget" in msg and "training state alone needs" in msg and "Adam m+v" in msg
    need = float(re.search(r"single.host_memory_gb to >= ([0-9.]+)", msg).group(1))
    assert need > 64 and make_plan(_7b(host_budget_bytes=int(need * GiB)), HW24).host_bytes["total"] <= need * GiB


def test_host_capacity_bounds_the_saved_activations() -> None:
    roomy = make_plan(_7b(), HW24)
    tight_budget = int(
        sum(v for k, v in roomy.host_bytes.items() if k not in ("saved activations", "total"))
        + roomy.host_bytes["saved activations"] * 0.3
    )
    tight = make_plan(_7b(host_budget_bytes=tight_budget), HW24)
    assert tight.host_bytes["total"] <= tight_budget
    assert tight.host_bytes["saved activations"] < roomy.host_bytes["saved activations"]


def test_bad_pins_are_refused_by_name() -> None:
    with pytest.raises(PlanError, match="single.round_sequences=5 must divide the global batch 64"):
        make_plan(_7b(round_sequences=5), HW24)
    with pytest.raises(PlanError, match="single.window=40 is more than the model's 32 blocks"):
        make_plan(_7b(window=40), HW24)
    with pytest.raises(PlanError, match="single.micro_batch_size=3 must divide"):
        make_plan(_7b(chunk=3), HW24)


def test_policies_and_compression_change_what_moves() -> None:
    dp = make_plan(_7b(), HW24)
    rows = {r["policy"]: r for r in dp.policy_rows}
    assert {"dp", "input", "attention", "projections", "matmuls", "everything"} <= set(rows)
    assert rows["input"]["recompute_s"] > rows["matmuls"]["recompute_s"] > rows["dp"]["recompute_s"] * 0.99 - 1e-9
    assert rows["dp"]["step_s"] <= min(r["step_s"] for r in dp.policy_rows) * 1.001  # the DP is the best option
    packed = make_plan(_7b(compress=True), HW24)
    assert packed.table.slot_bytes[3] < 0.6 * dp.table.slot_bytes[3]
    assert packed.times["recompute_s"] <= dp.times["recompute_s"]
    pyao = make_plan(_7b(policy="pyao"), HW24)
    assert "pyao" in pyao.table.names and pyao.levels[0] == pyao.table.names.index("pyao")
    fixed = make_plan(_7b(policy="input"), HW24)
    assert set(fixed.levels) == {0}


def test_tiny_model_fits_whole_and_grows_the_round() -> None:
    req = PlanRequest(
        model=TINY, seq_len=128, global_batch=16, precision="fp32", device_budget_bytes=GiB, host_budget_bytes=4 * GiB
    )
    hw = assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=4)
    plan = make_plan(req, hw)
    print(plan.render())
    assert plan.window == TINY.n_layers and plan.transfer_layers == 0
    assert plan.rounds == 1 and plan.round_sequences == 16
    assert "nothing slides" in plan.render()
    tiny_budget = PlanRequest(
        model=TINY,
        seq_len=128,
        global_batch=16,
        precision="fp32",
        device_budget_bytes=int(0.001 * GiB),
        host_budget_bytes=4 * GiB,
    )
    with pytest.raises(PlanError, match="cannot train within the budgets"):
        make_plan(tiny_budget, hw)


def _tiny_whole(**kw) -> PlanRequest:
    args = dict(
        model=TINY,
        seq_len=128,
        global_batch=16,
        precision="fp32",
        device_budget_bytes=GiB,
        host_budget_bytes=4 * GiB,
        keep_graph=True,
    )
    args.update(kw)
    return PlanRequest(**args)


def test_blocks_that_never_leave_the_device_keep_their_graphs() -> None:
    """Every block fits: each keeps its forward's autograd graph, its activation slots holding the
    layer input and what the graph saves, smaller than the level-'everything' slots they replace."""
    hw = assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=4)
    plan = make_plan(_tiny_whole(), hw)
    assert plan.window == TINY.n_layers and plan.keep_graph
    units, L, table = plan.units, plan.window, plan.table
    graph = table.profile.graph_bytes
    kept = kept_graph_layout(table.profile).nbytes
    assert graph is not None and kept == table.slot_bytes[0] + graph  # the level-0 slot: the input
    assert kept < table.slot_bytes[-1]
    assert plan.device_bytes["activation ring"] == L * units * align(kept)
    assert "keeps its forward's autograd graph" in plan.render()
    # the step recomputes nothing: the predicted step is the everything level's
    assert plan.times["recompute_s"] == 0.0
    # not where a block's graph could not live until its backward, or where it was not asked for
    counted = meta_profiler(TINY, 128, torch.float32, count_graph=True)  # graph bytes known, not asked for
    assert not make_plan(_tiny_whole(keep_graph=False), hw, profiler=counted).keep_graph
    assert not make_plan(_tiny_whole(policy="matmuls"), hw).keep_graph  # saves less than the graph holds
    assert not make_plan(_tiny_whole(window=2), hw).keep_graph  # blocks slide
    assert not make_plan(_tiny_whole(seq_chunk=32), hw).keep_graph  # a K/V cache rebuilt per chunk
    no_graph = make_plan(_tiny_whole(keep_graph=False), hw)
    assert no_graph.device_bytes["activation ring"] == L * units * align(table.slot_bytes[-1])
    assert plan.device_bytes["total"] < no_graph.device_bytes["total"]


def test_measured_cpu_hardware_is_usable_by_the_planner() -> None:
    torch_threads = torch.get_num_threads()
    hw = measure_hardware("cpu", torch.float32)
    assert torch.get_num_threads() == torch_threads
    for value in (
        hw.h2d_bytes_per_s,
        hw.d2h_bytes_per_s,
        hw.bidir_bytes_per_s,
        hw.matmul_flops_per_s,
        hw.device_mem_bytes_per_s,
        hw.host_free_bytes,
    ):
        assert value > 0 and math.isfinite(value)
    assert hw.kind == "cpu" and "measured" in hw.describe()
    plan = make_plan(
        PlanRequest(model=TINY, seq_len=64, global_batch=4, device_budget_bytes=GiB, host_budget_bytes=2 * GiB), hw
    )
    assert plan.device_bytes["total"] <= GiB


def test_plan_single_is_a_sysx_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    from sysx.cli import main

    assert main(["--help"]) == 0
    assert "plan-single" in capsys.readouterr().out
    assert (
        main(
            [
                "plan-single",
                "--model",
                "tiny",
                "--seq-len",
                "64",
                "--global-batch",
                "8",
                "--hardware",
                "rtx4090",
                "--device-gb",
                "2",
                "--host-gb",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "sysx single-GPU plan" in out and "autograd graph" not in out
    tiny = ["plan-single", "--model", "tiny", "--seq-len", "64", "--global-batch", "8", "--hardware", "rtx4090"]
    assert main([*tiny, "--device-gb", "2", "--host-gb", "8", "--keep-graph"]) == 0
    assert "keeps its forward's autograd graph" in capsys.readouterr().out
    assert (
        main(
            [
                "plan-single",
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
    assert "sysx plan-single: refused:" in capsys.readouterr().err


def test_plan_single_plans_the_precision_training_would_use(capsys: pytest.CaptureFixture[str]) -> None:
    """``--precision auto`` (the default) resolves as ``precision=auto`` of a job: fp32 on this CPU, bf16 on a GPU."""
    from sysx import device as dev
    from sysx.single.plan_cmd import main, plan_precision

    here = dev.default_precision(dev.resolve_device("auto"))
    assert plan_precision("auto", "measure") == here
    assert plan_precision("auto", "rtx4090") == "bf16" and plan_precision("fp16", "measure") == "fp16"
    args = ["--model", "tiny", "--seq-len", "64", "--global-batch", "8", "--host-gb", "8"]
    assert main([*args, "--hardware", "rtx4090", "--device-gb", "2"]) == 0
    assert ", bf16; seq_len" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert main(args) == 0
        assert ", fp32; seq_len" in capsys.readouterr().out


def test_untimed_profiles_are_made_once_per_shape_in_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's points plan the same Block again: its meta and untimed device profiles (ops and
    bytes, decided by the shapes) are made once per process; a timed one is made for each job."""
    from sysx.single import op_profile, plan_costs

    calls: list[bool] = []
    real = op_profile.profile_layer

    def counted(*args, **kw):
        calls.append(kw.get("measure", False))
        return real(*args, **kw)

    monkeypatch.setattr(op_profile, "profile_layer", counted)
    monkeypatch.setattr(plan_costs, "profile_layer", counted)
    monkeypatch.setattr(op_profile, "_UNMEASURED", {})
    plan_costs.meta_layer_profile.cache_clear()
    cfg = get_preset("tiny")
    meta = [plan_costs.meta_profiler(cfg, 64, torch.float32)(2, 64) for _ in range(2)]
    untimed = [
        op_profile.device_profiler(cfg, 64, torch.float32, torch.device("cpu"), measure=False)(2, 64) for _ in range(2)
    ]
    assert meta[0] is meta[1] and untimed[0] is untimed[1] and calls == [False, False]
    other = plan_costs.meta_profiler(cfg, 32, torch.float32)(2, 32)  # another shape is profiled
    timed = [
        op_profile.device_profiler(cfg, 64, torch.float32, torch.device("cpu"), measure=True)(2, 64) for _ in range(2)
    ]
    assert other.input.shape != meta[0].input.shape and timed[0] is not timed[1] and calls[2:] == [False, True, True]
