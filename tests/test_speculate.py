"""Adaptive speculation (``optim.speculate=auto|always|never``, sysx.optim.speculate).

* the K-clean-steps state machine, as a pure unit;
* the sliding window and the SysX pipeline (one process, and 2 ranks with gloo) with clipping that
  vetoes some steps and not others: every mode ends where the reference that clips ends (so no
  clipped step is left applied unclipped), and the per-step record (speculated, rolled back,
  re-stepped) is what the state machine says for the reference's clipping pattern.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sysx.config import (
    ConfigError,
    EvalSection,
    ModelSection,
    OptimSection,
    SingleSection,
    SysxConfig,
    TrainSection,
    validate,
)
from sysx.optim.speculate import SpeculationPolicy, window_mode
from sysx.runtime import PipelineOptions
from sysx.runtime.rank import exposed_seconds
from sysx.single.hardware import assumed_hardware
from sysx.trainers.pipeline import PipelineTrainer
from sysx.trainers.reference import ReferenceTrainer
from sysx.trainers.single import SingleTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 8
CLIP = 4.5  # the tiny model's norms over these 8 steps are 3.2-8.3: some steps clip, some do not
AFTER = 1  # speculate again after one clean step: every transition of the state machine happens
TOL = 1e-5  # losses
# parameters after 8 steps, per tensor vs its largest value: a rolled-back step is exact to an ulp
# (optim.rollback=undo) and the ulps grow over the steps; the run without clipping is 4e-2 away
PARAM_TOL = 1e-4


# ------------------------------------------------------------------------------ state machine
def run_policy(policy: SpeculationPolicy, clean: list[bool]) -> list[bool]:
    """The decision before each step, then the step's outcome fed back."""
    out = []
    for c in clean:
        out.append(policy.speculate())
        policy.record(clean=c)
    return out


def test_auto_speculates_until_a_veto_then_waits_for_k_clean_steps() -> None:
    clean = [True, True, False, True, True, False, False, True, True, True, True]
    assert run_policy(SpeculationPolicy("auto", 2), clean) == [
        True,
        True,
        True,  # optimistic at the start, the third step is vetoed
        False,
        False,  # two clean steps must pass
        True,  # ... then it speculates, and this one is vetoed
        False,
        False,
        False,  # the veto right after resets the count
        True,
        True,
    ]
    assert run_policy(SpeculationPolicy("auto", 0), clean) == [True] * len(clean)  # K=0: always again at once


def test_always_and_never_ignore_outcomes_and_auto_speculates_when_nothing_can_veto() -> None:
    clean = [False, True, False, True]
    assert run_policy(SpeculationPolicy("always"), clean) == [True] * 4
    assert run_policy(SpeculationPolicy("never"), clean) == [False] * 4
    assert run_policy(SpeculationPolicy("auto", 3, can_veto=False), clean) == [True] * 4


def test_policy_state_round_trips_and_bad_values_name_the_key() -> None:
    a = SpeculationPolicy("auto", 3)
    run_policy(a, [False, True])
    b = SpeculationPolicy("auto", 3)
    b.load_state_dict(a.state_dict())
    assert run_policy(b, [True, True, True]) == run_policy(a, [True, True, True]) == [False, False, True]
    with pytest.raises(ValueError, match="optim.speculate='sometimes'"):
        SpeculationPolicy("sometimes")
    with pytest.raises(ValueError, match="optim.speculate_after=-1"):
        SpeculationPolicy("auto", -1)


def test_window_overlap_spells_the_same_choice() -> None:
    assert window_mode("auto", "never") == "never"
    assert window_mode("backward", "auto") == window_mode("backward", "always") == "always"
    assert window_mode("forward", "auto") == "never"
    with pytest.raises(ValueError, match="single.optimizer_overlap=forward means optim.speculate=never"):
        window_mode("forward", "always")


def test_config_checks_speculate() -> None:
    with pytest.raises(ConfigError, match="optim.speculate"):
        validate(SysxConfig(optim=OptimSection(speculate="maybe")))
    with pytest.raises(ConfigError, match="optim.speculate_after"):
        validate(SysxConfig(optim=OptimSection(speculate_after=-2)))


def test_exposed_time_spans_last_backward_to_last_validate() -> None:
    assert exposed_seconds([10.0, 12.0], [13.0, 13.5], one_clock=True) == pytest.approx(1.5)
    assert exposed_seconds([10.0, 112.0], [13.0, 113.5], one_clock=False) == pytest.approx(1.5)  # clocks apart


# ---------------------------------------------------------------------------------- trainers
def make_cfg(clip: float, mode: str, *, micro_batches: int = 2) -> SysxConfig:
    cfg = SysxConfig(
        model=ModelSection(preset="tiny"),
        train=TrainSection(steps=STEPS, micro_batch_size=2, micro_batches=micro_batches, seq_len=16),
        optim=OptimSection(warmup_steps=2, grad_clip=clip, speculate=mode, speculate_after=AFTER),
        eval=EvalSection(every=0, batches=2),
        device="cpu",
    )
    validate(cfg)
    return cfg


_REF: dict[tuple[float, int], tuple[list, dict[str, torch.Tensor]]] = {}


def reference(clip: float, micro_batches: int = 2) -> tuple[list, dict[str, torch.Tensor]]:
    key = (clip, micro_batches)
    if key not in _REF:
        trainer = ReferenceTrainer(make_cfg(clip, "auto", micro_batches=micro_batches))
        _REF[key] = (trainer.run(STEPS), trainer.state_dict())
    return _REF[key]


def param_rel(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((state[k] - v).abs().max() / v.abs().max()) for k, v in ref.items())


def expected_record(mode: str, ref_results: list) -> list[bool]:
    """Which steps speculate, from the reference's clipping pattern (the same global norms)."""
    return run_policy(SpeculationPolicy(mode, AFTER), [r.grad_norm <= CLIP for r in ref_results])


def check_run(mode: str, results: list, state: dict[str, torch.Tensor], micro_batches: int = 2) -> None:
    ref_results, ref_state = reference(CLIP, micro_batches)
    clipped = [r.grad_norm > CLIP for r in ref_results]
    assert any(clipped) and not all(clipped)  # the clipping path and the clean path both ran
    assert param_rel(state, ref_state) <= PARAM_TOL, param_rel(state, ref_state)
    # the same run without clipping ends far away: a clipped step left unclipped would show
    assert param_rel(reference(0.0, micro_batches)[1], ref_state) > 100 * PARAM_TOL
    assert max(abs(a.loss - b.loss) / b.loss for a, b in zip(results, ref_results)) <= TOL
    speculated = [r.speculated for r in results]
    assert speculated == expected_record(mode, ref_results), (speculated, clipped)
    for r, c in zip(results, clipped):
        assert (r.restepped > 0) == (r.speculated and c), (r, c)  # a re-step only after a vetoed speculation
        assert r.rolled_back == r.restepped  # no overflow here: every rollback is a clipping re-step
        assert r.opt_exposed_s is not None and 0.0 <= r.opt_exposed_s <= r.step_time_s  # waits inside the step


@pytest.mark.parametrize("mode", ["auto", "always", "never"])
def test_window_modes_match_the_clipping_reference(mode: str) -> None:
    cfg = make_cfg(CLIP, mode)
    single = SingleSection(window=2, policy="dp", round_sequences=4, micro_batch_size=2, print_plan=False)
    hw = assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=8)
    with SingleTrainer(cfg, single=single, hardware=hw, optimizer_backend="torch", device="cpu") as trainer:
        results = trainer.run(STEPS)
        state = trainer.state_dict()
    check_run(mode, results, state)


def test_window_refuses_two_settings_that_disagree() -> None:
    single = SingleSection(optimizer_overlap="backward", print_plan=False)
    hw = assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=8)
    with pytest.raises(ConfigError, match="optim.speculate=never"):
        SingleTrainer(make_cfg(CLIP, "never"), single=single, hardware=hw, optimizer_backend="torch", device="cpu")


@pytest.mark.parametrize("mode", ["auto", "always", "never"])
def test_pipeline_modes_match_the_clipping_reference(mode: str) -> None:
    cfg = make_cfg(CLIP, mode)
    opts = PipelineOptions(schedule="sysx", split=2, optim_backend="torch")
    with PipelineTrainer(cfg, opts) as trainer:
        results = trainer.run(STEPS)
        state = trainer.state_dict()
    check_run(mode, results, state)


@pytest.mark.slow
def test_two_ranks_decide_alike_and_match_the_clipping_reference(tmp_path: Path) -> None:
    from test_runtime_procs import run_parity

    schedules = [
        {"schedule": "sysx", "split": 2, "stages_per_rank": 1, "optim": {"speculate": mode}}
        for mode in ("auto", "never")
    ]
    result = run_parity(
        tmp_path,
        world=2,
        local_world=2,
        model={"preset": "tiny"},
        steps=STEPS,
        train={"micro_batch_size": 2, "micro_batches": 3, "seq_len": 16},
        optim={"warmup_steps": 2, "grad_clip": CLIP, "speculate_after": AFTER},
        schedules=schedules,
    )
    auto, never = result["rows"]
    clean = [n <= CLIP for n in auto["ref_norms"]]
    assert any(clean) and not all(clean)
    assert auto["speculated"] == run_policy(SpeculationPolicy("auto", AFTER), clean)
    assert never["speculated"] == [False] * STEPS and never["restepped"] == [0] * STEPS
    # every stage on both ranks re-stepped after each vetoed speculation (2 stages x 2 sub-stages, and
    # the second shard of the last one, whose step the two ranks share: schedule.spread_last_step)
    assert [r > 0 for r in auto["restepped"]] == [s and not c for s, c in zip(auto["speculated"], clean)]
    assert {r for r in auto["restepped"] if r} == {5}
