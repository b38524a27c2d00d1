"""Weight-decay groups (``optim.decay_norms``, :mod:`sysx.optim.decay`): every CPU Adam path over a
real Block + Head flat buffer equals ``torch.optim.AdamW`` with two parameter groups (matrices
decayed, 1-D norm weights not) over 20 steps within 1e-6, and ``decay_norms=true`` equals the old
single group. ``dim=40`` puts the norm ranges at offsets and lengths that are no multiple of any
SIMD width, so the DeepSpeed op's scalar tails run on both sides of every range edge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from sysx.config import (
    CheckpointSection,
    EvalSection,
    ModelSection,
    OptimSection,
    SingleSection,
    SysxConfig,
    TrainSection,
)
from sysx.model import FlatLayout, ModelConfig
from sysx.model.llama import make_layer, seed_init
from sysx.optim import CpuAdam
from sysx.optim.decay import decay_runs, no_decay_ranges, shard_ranges
from sysx.optim.device_lane import DeviceLane
from sysx.optim.stage import OptimSettings, StageOptimizer
from sysx.single.hardware import assumed_hardware
from sysx.trainers.checkpointing import JobCheckpoints
from sysx.trainers.reference import ReferenceTrainer
from sysx.trainers.single import SingleTrainer

CFG = ModelConfig(vocab_size=64, dim=40, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=72)
STEPS, LR, WD, BETAS = 20, 1e-3, 0.1, (0.9, 0.95)
HW = assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=8)
WINDOW = SingleSection(window=2, micro_batch_size=1, round_sequences=2, policy="input", print_plan=False)

pytestmark = pytest.mark.usefixtures("one_thread")


def block_and_head() -> tuple[FlatLayout, torch.Tensor]:
    """A Block and the Head (RMSNorm weights at offsets 0, 40 + 4800 and 10_520) as one fp32 buffer;
    the norm weights moved off 1.0 so that decaying them shows."""
    layers = [make_layer(CFG, i) for i in (1, 2)]
    for layer, i in zip(layers, (1, 2)):
        seed_init(0)(layer, i)
    layout = FlatLayout.from_modules(layers)
    flat = layout.flatten(layers)
    for lo, hi in no_decay_ranges(e.shape for e in layout.entries):
        flat[lo:hi] += torch.linspace(-0.3, 0.3, hi - lo)
    return layout, flat


def torch_adamw(layout: FlatLayout, flat: torch.Tensor, grads: list[torch.Tensor], two_groups: bool) -> torch.Tensor:
    """``torch.optim.AdamW`` over the layout's parameters, grouped by hand as nanoGPT does (dim >= 2
    decayed); the flat parameters after the steps."""
    params = [nn.Parameter(v.clone()) for v in layout.views(flat.clone())]
    groups = [{"params": params, "weight_decay": WD}]
    if two_groups:
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=1e-8)
    for s, g in enumerate(grads):
        for p, view in zip(params, layout.views(g)):
            p.grad = view.clone()
        for group in opt.param_groups:
            group["lr"] = lr_of(s)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


def lr_of(step: int) -> float:
    return LR * (1 + step) / STEPS  # a changing rate, as under warmup


def gradients(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(n, generator=gen) * 1e-2 for _ in range(STEPS)]


def run_rejecting(opt: CpuAdam, grads: list[torch.Tensor]) -> None:
    """Every fourth step is first taken with wrong gradients and rolled back (a rejected speculative
    step), then taken with the right ones: the rollback path runs on the no-decay runs too."""
    for s, g in enumerate(grads):
        if s % 4 == 3:
            wrong = g * -3.0
            opt.step(wrong, lr=lr_of(s))
            opt.undo(wrong)
        opt.step(g, lr=lr_of(s))


def run_on_device_lane(opt: CpuAdam, grads: list[torch.Tensor]) -> None:
    lane = DeviceLane("cpu")
    for s, g in enumerate(grads):
        lane.step(opt, g, lr=lr_of(s))
    lane.close()


PATHS: dict[str, tuple[str, str, Callable[[CpuAdam, list[torch.Tensor]], None]]] = {
    "deepspeed": ("deepspeed", "undo", run_rejecting),
    "torch": ("torch", "undo", run_rejecting),
    "deepspeed-exact": ("deepspeed", "exact", run_rejecting),
    "torch-exact": ("torch", "exact", run_rejecting),
    "torch-snapshot": ("torch", "snapshot", run_rejecting),
    "device-lane": ("torch", "exact", run_on_device_lane),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_cpu_adam_paths_equal_adamw_with_two_groups(path: str) -> None:
    backend, rollback, run = PATHS[path]
    layout, flat = block_and_head()
    ranges = no_decay_ranges(e.shape for e in layout.entries)
    grads = gradients(layout.numel)
    opt = CpuAdam(
        flat.clone(), lr=LR, betas=BETAS, weight_decay=WD, backend=backend, rollback=rollback, no_decay=ranges
    )
    run(opt, grads)
    want = torch_adamw(layout, flat, grads, two_groups=True)
    assert float((opt.param - want).abs().max()) <= 1e-6
    opt.close()


def test_decay_norms_true_is_the_old_single_group() -> None:
    """``decay_norms=true`` drops the ranges: every parameter decays, as torch's single group; the
    two-group result is far from it on the norm weights (so the comparisons above can fail)."""
    layout, flat = block_and_head()
    ranges = no_decay_ranges(e.shape for e in layout.entries)
    grads = gradients(layout.numel)
    settings = OptimSettings(
        lr=LR, betas=BETAS, eps=1e-8, weight_decay=WD, grad_clip=0.0, backend="torch", decay_norms=True
    )
    stage = StageOptimizer.from_settings("s0.0", flat.clone(), settings, no_decay=ranges)
    assert stage.optimizer.no_decay == ()
    for s, g in enumerate(grads):
        stage.optimizer.step(g, lr=lr_of(s))
    one_group = torch_adamw(layout, flat, grads, two_groups=False)
    two_groups = torch_adamw(layout, flat, grads, two_groups=True)
    assert float((stage.master - one_group).abs().max()) <= 1e-6
    lo, hi = ranges[0]
    assert float((one_group[lo:hi] - two_groups[lo:hi]).abs().max()) > 1e-4
    stage.close()


def test_ranges_are_the_norm_weights_of_the_layout() -> None:
    layout, _ = block_and_head()
    ranges = no_decay_ranges(e.shape for e in layout.entries)
    norms = [(e.offset, e.offset + e.numel) for e in layout.entries if e.name.endswith("norm.weight")]
    assert ranges == tuple(norms) and len(norms) == 3  # two per Block, the Head's


def test_shards_and_runs() -> None:
    ranges = ((0, 4), (10, 12), (20, 30))
    assert shard_ranges(ranges, 3, 25) == ((0, 1), (7, 9), (17, 22))
    assert shard_ranges(ranges, 12, 20) == ()
    runs = decay_runs(32, 8, ranges)
    assert runs == [
        (0, 4, False),
        (4, 8, True),
        (8, 10, True),
        (10, 12, False),
        (12, 16, True),
        (16, 20, True),
        (20, 24, False),
        (24, 30, False),
        (30, 32, True),
    ]
    assert no_decay_ranges([(4,), (3,), (2, 2), (5,)]) == ((0, 7), (11, 16))


@pytest.mark.parametrize("bad", [((5, 3),), ((0, 4), (2, 6)), ((0, 99),)])
def test_bad_ranges_are_one_line(bad: tuple[tuple[int, int], ...]) -> None:
    with pytest.raises(ValueError, match="no_decay range .* sorted, disjoint and within"):
        CpuAdam(torch.zeros(16), lr=1e-3, backend="torch", no_decay=bad)


def test_a_checkpoint_of_the_old_rule_resumes_and_follows_the_key(tmp_path: Path) -> None:
    """Nothing about decay is stored: a checkpoint written with every parameter decayed (sysx before
    optim.decay_norms, or decay_norms=true) resumes under the default, in the window and in the
    reference loop alike, and from there on the norm weights are not decayed."""
    cfg = SysxConfig(
        model=ModelSection(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64),
        train=TrainSection(steps=4, micro_batch_size=2, micro_batches=2, seq_len=16),
        optim=OptimSection(lr=1e-2, warmup_steps=0, weight_decay=0.1, decay_norms=True),
        eval=EvalSection(every=0),
        device="cpu",
        checkpoint=CheckpointSection(dir=str(tmp_path / "ckpt")),
        run_dir=str(tmp_path / "run"),
    )
    with SingleTrainer(cfg, single=WINDOW, hardware=HW) as t:
        t.run(2)
        saver = JobCheckpoints(t)
        saver.save(background=False)
        saver.close()
    ends: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}
    for name, decay_norms in (("single", False), ("reference", False), ("single-old-rule", True)):
        run_cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, decay_norms=decay_norms))
        with (
            SingleTrainer(run_cfg, single=WINDOW, hardware=HW) if name != "reference" else ReferenceTrainer(run_cfg)
        ) as t:
            resumer = JobCheckpoints(t)
            assert resumer.resume() is not None and t.step_index == 2
            losses = [r.loss for r in t.run(2)]
            ends[name] = (losses, t.state_dict())
            resumer.close()
    norm = "layers.3.norm.weight"
    single, reference, old = ends["single"], ends["reference"], ends["single-old-rule"]
    assert single[0] == pytest.approx(reference[0], rel=1e-5)
    assert float((single[1][norm] - reference[1][norm]).abs().max()) <= 1e-6
    assert float((single[1][norm] - old[1][norm]).abs().max()) > 1e-5
