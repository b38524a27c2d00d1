"""The one speculate-or-validate decision both trainers call (:class:`sysx.optim.step_protocol.StepProtocol`),
on CPU stages without a trainer: speculation (step, then undo and re-step when clipped), validate
first (check, then step) and the device lane (after the decision, clipped, never re-stepped) all
end where ``clip_grad_norm_`` + ``torch.optim.AdamW`` ends, and, with ``optim.rollback=exact``,
bit for bit where one another end; the policy decides each step, a skipped step steps nothing, the
pacer charges the device lane in its order, and the spare refresh skips the device lane."""

from __future__ import annotations

import threading

import pytest
import torch

from sysx.optim import OptimizerThreads, StageOptimizer, make_scaler
from sysx.optim.device_lane import DeviceLane
from sysx.optim.speculate import SpeculationPolicy
from sysx.optim.stage import OptimSettings
from sysx.optim.step_protocol import UNTIMED, StepProtocol

SIZES = {"s1.1": 3001, "s1.0": 2003, "s0.1": 4007}  # backward order: later stages first
CLIP = 5.0
ITERS = 6
HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = threading.active_count()
    yield
    assert threading.active_count() == before


def _masters() -> list[torch.Tensor]:
    return [
        torch.randn(n, generator=torch.Generator().manual_seed(100 + i)) * 0.02 for i, n in enumerate(SIZES.values())
    ]


def _grads(it: int, precision: str = "fp32") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + it)
    scale = 0.05 if it == 3 else 1.0  # iteration 3 stays under the clipping threshold, the others clip
    dtype = torch.float16 if precision == "fp16" else torch.float32
    return {name: (torch.randn(n, generator=gen) * 0.5 * scale).to(dtype) for name, n in SIZES.items()}


class LanePacerSpy:
    """Records the device lane's charges."""

    def __init__(self) -> None:
        self.calls: list[object] = []

    def device_optimizer(self, name: str, seconds: tuple[float, float, float]) -> None:
        self.calls.append((name, seconds))

    def device_optimizer_wait(self) -> None:
        self.calls.append("wait")


def run(
    mode: str,
    rollback: str,
    device: tuple[str, ...] = (),
    *,
    pacer: LanePacerSpy | None = None,
) -> tuple[list[torch.Tensor], list, list[bool], list[list[str]]]:
    """Every iteration as the trainers drive the protocol: submit per stage, decide, wait, record.
    Returns the masters and moments, the outcomes, whether each step speculated and the stages
    that stepped before their validation."""
    stages = [
        StageOptimizer(name, m, backend="torch", rollback=rollback, **HYPER) for name, m in zip(SIZES, _masters())
    ]
    settings = OptimSettings(
        **HYPER, grad_clip=CLIP, backend="torch", rollback=rollback, speculate=mode, speculate_after=1
    )
    outcomes, speculated, stepped_early = [], [], []
    with OptimizerThreads(stages, workers=2) as threads:
        scaler = make_scaler("fp32")
        protocol = StepProtocol(threads, scaler, settings, fp16=False)
        if device:
            protocol.use_device_lane({n: (0.1 * i, 0.2, 0.3) for i, n in enumerate(device)}, DeviceLane("cpu"), pacer)
        for it in range(ITERS):
            lr = 1e-3 * (it + 1) / ITERS
            speculated.append(protocol.begin())
            for name, g in _grads(it).items():
                protocol.submit(name, g, None, scale=1.0, lr=lr)
            reports = threads.wait()
            stepped_early.append([r.stage for r in reports if r.stepped])
            outcome = protocol.decide(reports, lr)
            threads.wait_stages()
            protocol.record(outcome)
            outcomes.append(outcome)
        protocol.close()
    state = [t.clone() for s in stages for t in (s.master, s.optimizer.exp_avg, s.optimizer.exp_avg_sq)]
    for s in stages:
        s.close()
    return state, outcomes, speculated, stepped_early


def reference() -> list[torch.Tensor]:
    """``clip_grad_norm_`` then ``torch.optim.AdamW``, every iteration."""
    params = [torch.nn.Parameter(m.clone()) for m in _masters()]
    opt = torch.optim.AdamW(params, **HYPER)
    for it in range(ITERS):
        for p, g in zip(params, _grads(it).values()):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.param_groups[0]["lr"] = 1e-3 * (it + 1) / ITERS
        opt.step()
    return [t.detach() for p in params for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]


PATHS = [
    ("never", ()),  # validate first: check, then every stage steps on the workers
    ("never", ("s0.1", "s1.1")),  # ... two of them on the device lane
    ("always", ()),  # speculate: step, then undo and re-step the clipped ones
    ("always", ("s1.0",)),  # ... the device lane's stage steps after the decision only
    ("auto", ("s1.1",)),  # the policy alternates between the two
]


@pytest.mark.parametrize("mode,device", PATHS)
def test_every_path_ends_where_clipping_then_adamw_ends(mode: str, device: tuple[str, ...]) -> None:
    state, outcomes, _, _ = run(mode, "undo", device)
    assert [o.clip_coef < 1.0 for o in outcomes] == [it != 3 for it in range(ITERS)]
    # per stage: masters, first and second moments (torch backend vs torch.optim.AdamW, test_validation's bounds)
    tolerances = [(ITERS * 1e-7 + 1e-8, 0.0), (1e-8, 1e-5), (1e-10, 5e-5)] * len(SIZES)
    for got, want, (atol, rtol) in zip(state, reference(), tolerances):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_with_exact_rollback_every_path_ends_bit_identical() -> None:
    """Undone by switching buffer sets, a speculated step leaves no trace: every path, device lane
    or not, ends on the very bits of validating first on the CPU lane."""
    first, _, _, _ = run("never", "exact")
    for mode, device in PATHS[1:]:
        state, _, _, _ = run(mode, "exact", device)
        assert all(torch.equal(a, b) for a, b in zip(state, first)), (mode, device)


def test_the_policy_decides_and_the_device_lane_steps_after_the_decision_only() -> None:
    _, outcomes, speculated, stepped_early = run("auto", "undo", ("s1.1",))
    policy, expected = SpeculationPolicy("auto", 1), []
    for o in outcomes:
        expected.append(policy.speculate())
        policy.record(clean=o.clip_coef == 1.0)
    assert speculated == expected == [True, False, False, False, True, False]
    for spec, early, o in zip(speculated, stepped_early, outcomes):
        assert early == (["s1.0", "s0.1"] if spec else [])  # never the device lane's s1.1
        assert o.restepped == (2 if spec and o.clip_coef < 1.0 else 0)


def test_the_pacer_charges_the_device_lane_in_its_order() -> None:
    pacer = LanePacerSpy()
    run("never", "undo", ("s0.1", "s1.1"), pacer=pacer)
    one_step = [("s0.1", (0.0, 0.2, 0.3)), ("s1.1", (0.1, 0.2, 0.3)), "wait"]
    assert pacer.calls == one_step * ITERS


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_skipped_step_steps_nothing(mode: str) -> None:
    stages = [  # snapshot: a rolled-back step leaves the very bits it found
        StageOptimizer(name, m, backend="torch", rollback="snapshot", **HYPER) for name, m in zip(SIZES, _masters())
    ]
    before = [s.master.clone() for s in stages]
    settings = OptimSettings(**HYPER, grad_clip=CLIP, backend="torch", rollback="snapshot", speculate=mode)
    pacer = LanePacerSpy()
    grads = {k: v.half() for k, v in _grads(0).items()}
    grads["s1.0"][7] = float("inf")
    with OptimizerThreads(stages, workers=2) as threads:
        protocol = StepProtocol(threads, make_scaler("fp16", init_scale=4.0), settings, fp16=True)
        protocol.use_device_lane({"s0.1": UNTIMED}, DeviceLane("cpu"), pacer)
        protocol.begin()
        for name, g in grads.items():
            protocol.submit(name, g, None, scale=4.0, lr=1e-3)
        outcome = protocol.decide(threads.wait(), 1e-3)
        threads.wait_stages()
        assert outcome.skipped and outcome.undone == (1 if mode == "always" else 0)  # s1.1 stepped; s1.0 overflowed
        assert not protocol.record(outcome)
        protocol.close()
    assert pacer.calls == []
    assert all(torch.equal(s.master, b) for s, b in zip(stages, before))
    for s in stages:
        assert s.optimizer.step_count == 0
        s.close()


def test_the_spare_refresh_skips_the_device_lane_and_waits_for_a_speculating_step() -> None:
    stages = [StageOptimizer(name, m, backend="torch", rollback="exact", **HYPER) for name, m in zip(SIZES, _masters())]
    settings = OptimSettings(**HYPER, grad_clip=CLIP, backend="torch", rollback="exact", speculate="auto")
    refreshed: list[list[str]] = []
    with OptimizerThreads(stages, workers=2) as threads:
        threads.refresh_spares = lambda names: refreshed.append(list(names))  # type: ignore[method-assign]
        protocol = StepProtocol(threads, make_scaler("fp32"), settings, fp16=False)
        protocol.use_device_lane({"s1.0": UNTIMED}, DeviceLane("cpu"))
        for it in (3, 0):  # clean: the next step speculates; clipped: auto validates first next
            protocol.begin()
            for name, g in _grads(it).items():
                protocol.submit(name, g, None, scale=1.0, lr=1e-3)
            outcome = protocol.decide(threads.wait(), 1e-3)
            threads.wait_stages()
            protocol.record(outcome)
        protocol.close()
    assert refreshed == [["s1.1", "s0.1"]]
    for s in stages:
        s.close()
