"""The reference trainer against hand-written torch loops: fp32 exactness, clipping, LR, bf16, fp16 skip."""

from __future__ import annotations

import math

import pytest
import torch

from sysx.config import (
    ConfigError,
    EvalSection,
    LossScaleSection,
    ModelSection,
    OptimSection,
    SysxConfig,
    TrainSection,
    model_config,
    validate,
)
from sysx.data import TokenDataset, default_corpus_path, get_batch
from sysx.dist import DistInfo
from sysx.model import build_model
from sysx.optim.loss_scaler import NonFiniteGradients
from sysx.optim.lr_schedule import lr_at
from sysx.trainers.reference import ReferenceTrainer, check_single_process


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return TokenDataset(default_corpus_path())


def small_cfg(precision: str = "fp32", **train: int) -> SysxConfig:
    """A model and batch small enough for fp16 on CPU (fp16 matmul is ~1 GFLOP/s there)."""
    cfg = SysxConfig(
        model=ModelSection(preset="tiny", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64),
        train=TrainSection(**{"steps": 6, "micro_batch_size": 2, "micro_batches": 3, "seq_len": 16, **train}),
        optim=OptimSection(lr=0.01, warmup_steps=2, min_lr=0.001, grad_clip=0.5, weight_decay=0.1),
        eval=EvalSection(every=0),
        precision=precision,
        device="cpu",
        seed=3,
    )
    validate(cfg)
    return cfg


def hand_written_loop(cfg: SysxConfig, dataset: TokenDataset, steps: int) -> tuple[list[float], list[float], dict]:
    """The plain torch loop the reference trainer must equal bit for bit in fp32: AdamW with nanoGPT's
    two parameter groups (matrices decayed, 1-D norm weights not; one group with optim.decay_norms)."""
    t, o = cfg.train, cfg.optim
    model = build_model(model_config(cfg), seed=cfg.seed)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if o.decay_norms:
        groups = [{"params": params, "weight_decay": o.weight_decay}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for j in range(t.micro_batches):
            x, y = get_batch(
                dataset, seed=cfg.seed, step=step, micro_batch=j, micro_batch_size=t.micro_batch_size, seq_len=t.seq_len
            )
            loss = model.loss(x, y)
            (loss / t.micro_batches).backward()
            step_loss += loss.item() / t.micro_batches
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=o.lr, warmup_steps=o.warmup_steps, total_steps=t.steps, min_lr=o.final_lr)
        opt.step()
        losses.append(step_loss)
    return losses, norms, dict(model.named_parameters())


def test_fp32_step_equals_a_hand_written_loop(dataset: TokenDataset) -> None:
    cfg = small_cfg()
    trainer = ReferenceTrainer(cfg, dataset=dataset)
    results = trainer.run(4)
    losses, norms, params = hand_written_loop(cfg, dataset, 4)
    state = trainer.state_dict()
    assert state.keys() == params.keys()
    for name, value in params.items():
        assert torch.equal(state[name], value.detach()), name
    assert [r.loss for r in results] == pytest.approx(losses, rel=1e-6)
    assert [r.grad_norm for r in results] == pytest.approx(norms, rel=1e-6)
    assert [r.step for r in results] == [0, 1, 2, 3]
    assert not any(r.skipped for r in results) and all(r.scale == 1.0 for r in results)
    assert all(r.tokens == cfg.tokens_per_step and r.step_time_s > 0 for r in results)


def test_decay_norms_true_is_one_group_decaying_everything(dataset: TokenDataset) -> None:
    """optim.decay_norms=true restores the old single AdamW group (the norm weights decayed too),
    still equal to the hand-written loop; the default leaves the norm weights undecayed, so they differ."""
    cfg = small_cfg()
    cfg.optim.decay_norms = True
    trainer = ReferenceTrainer(cfg, dataset=dataset)
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1]
    trainer.run(3)
    _, _, params = hand_written_loop(cfg, dataset, 3)
    state = trainer.state_dict()
    for name, value in params.items():
        assert torch.equal(state[name], value.detach()), name
    default = ReferenceTrainer(small_cfg(), dataset=dataset)
    no_decay = default.optimizer.param_groups[1]
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert len(no_decay["params"]) == 2 * cfg.model.n_layers + 1  # two RMSNorms per block, the head's
    default.run(3)
    norm = "layers.3.norm.weight"
    assert not torch.equal(default.state_dict()[norm], state[norm])


def test_gradient_clipping_matches_clip_grad_norm(dataset: TokenDataset) -> None:
    cfg = small_cfg()
    trainer = ReferenceTrainer(cfg, dataset=dataset)
    # Step 0 by hand up to the clip: the pre-clip norm, and the clipped gradients.
    model = build_model(model_config(cfg), seed=cfg.seed)
    for j in range(cfg.train.micro_batches):
        x, y = get_batch(dataset, seed=cfg.seed, step=0, micro_batch=j, micro_batch_size=2, seq_len=16)
        (model.loss(x, y) / cfg.train.micro_batches).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip))
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert norm > cfg.optim.grad_clip  # the test exercises clipping
    assert float(clipped.norm()) == pytest.approx(cfg.optim.grad_clip, rel=1e-5)

    seen = {}
    original = trainer.optimizer.step

    def spy() -> None:  # the gradients AdamW receives
        seen["grads"] = torch.cat([p.grad.flatten() for p in trainer.masters])
        original()

    trainer.optimizer.step = spy  # type: ignore[method-assign]
    result = trainer.train_step()
    assert result.grad_norm == pytest.approx(norm, rel=1e-6)
    assert torch.equal(seen["grads"], clipped)


def test_no_clipping_when_grad_clip_is_zero(dataset: TokenDataset) -> None:
    cfg = small_cfg()
    cfg.optim.grad_clip = 0.0
    trainer = ReferenceTrainer(cfg, dataset=dataset)
    seen = {}
    original = trainer.optimizer.step

    def spy() -> None:
        seen["norm"] = float(torch.cat([p.grad.flatten() for p in trainer.masters]).norm())
        original()

    trainer.optimizer.step = spy  # type: ignore[method-assign]
    result = trainer.train_step()
    assert result.grad_norm > 0.5
    assert seen["norm"] == pytest.approx(result.grad_norm, rel=1e-5)


def test_lr_schedule_is_applied(dataset: TokenDataset) -> None:
    cfg = small_cfg(steps=6)
    trainer = ReferenceTrainer(cfg, dataset=dataset)
    applied = []
    original = trainer.optimizer.step

    def spy() -> None:
        applied.append(trainer.optimizer.param_groups[0]["lr"])
        original()

    trainer.optimizer.step = spy  # type: ignore[method-assign]
    results = trainer.run()
    o = cfg.optim
    expected = [lr_at(s, lr=o.lr, warmup_steps=o.warmup_steps, total_steps=6, min_lr=o.final_lr) for s in range(6)]
    assert applied == expected == [r.lr for r in results]
    assert expected[0] == o.lr / 2 and expected[1] == o.lr and expected[-1] > o.final_lr


def test_bf16_runs_with_fp32_masters(dataset: TokenDataset) -> None:
    cfg = small_cfg("bf16")
    trainer = ReferenceTrainer(cfg, dataset=dataset)
    results = trainer.run(3)
    assert all(math.isfinite(r.loss) and math.isfinite(r.grad_norm) and not r.skipped for r in results)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    state = trainer.state_dict()
    for name, p in trainer.model.named_parameters():
        assert state[name].dtype == torch.float32
        assert torch.equal(p.detach(), state[name].to(torch.bfloat16)), name  # params = rounded masters
    # The masters start from the exact fp32 initialisation, not from its bf16 rounding.
    fresh = ReferenceTrainer(cfg, dataset=dataset).state_dict()
    fp32_init = dict(build_model(model_config(cfg), seed=cfg.seed).named_parameters())
    assert all(torch.equal(fresh[n], fp32_init[n].detach()) for n in fresh)
    # And training moved them.
    assert any(not torch.equal(state[n], fresh[n]) for n in state)


def test_fp16_skips_the_step_with_an_inf_gradient(dataset: TokenDataset) -> None:
    cfg = small_cfg("fp16", steps=4, micro_batches=1, seq_len=8)
    cfg.loss_scale = LossScaleSection(init=1024.0, growth_interval=1000, backoff=0.5, min=1.0)
    trainer = ReferenceTrainer(cfg, dataset=dataset)
    target = trainer.params[0]
    inject = {"step": 1}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if trainer.step_index == inject["step"]:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    target.register_hook(hook)
    before = {}

    def remember(result: object) -> None:
        before[trainer.step_index] = trainer.state_dict()

    before[0] = trainer.state_dict()
    results = trainer.run(4, on_step=remember)
    assert [r.skipped for r in results] == [False, True, False, False]
    assert [r.scale for r in results] == [1024.0, 1024.0, 512.0, 512.0]
    assert math.isinf(results[1].grad_norm) and math.isfinite(results[2].grad_norm)
    assert all(math.isfinite(r.loss) for r in results)
    # The skipped step left the fp32 masters and Adam's step count alone.
    assert all(torch.equal(before[1][n], before[2][n]) for n in before[1])
    assert any(not torch.equal(before[2][n], before[3][n]) for n in before[2])
    assert trainer.scaler.skipped_steps == 1
    assert trainer.optimizer.state[trainer.masters[0]]["step"].item() == 3


def test_fp16_loss_scale_unscales_gradients(dataset: TokenDataset) -> None:
    """With a loss scale the fp32 master gradients equal the unscaled ones (up to fp16 rounding)."""
    cfg = small_cfg("fp16", steps=1, micro_batches=1, seq_len=8)
    cfg.optim.grad_clip = 0.0
    low = ReferenceTrainer(cfg, dataset=dataset).train_step()
    cfg.loss_scale.init = 4096.0
    high = ReferenceTrainer(cfg, dataset=dataset).train_step()
    assert (low.scale, high.scale) == (65536.0, 4096.0) and not low.skipped and not high.skipped
    assert high.grad_norm == pytest.approx(low.grad_norm, rel=1e-2)
    assert high.loss == low.loss


def test_bf16_non_finite_gradients_stop_training(dataset: TokenDataset) -> None:
    cfg = small_cfg("bf16", steps=2)
    trainer = ReferenceTrainer(cfg, dataset=dataset)
    trainer.params[0].register_hook(lambda g: torch.full_like(g, float("nan")))
    with pytest.raises(NonFiniteGradients, match="bf16"):
        trainer.train_step()


def test_evaluation_is_deterministic(dataset: TokenDataset) -> None:
    cfg = small_cfg(steps=2)
    cfg.eval = EvalSection(every=1, batches=2)
    trainer = ReferenceTrainer(cfg, dataset=dataset)
    first = trainer.evaluate()
    assert first == trainer.evaluate() and math.isfinite(first)
    results = trainer.run()
    assert all(r.val_loss is not None for r in results)


def test_only_one_process() -> None:
    check_single_process(DistInfo())
    with pytest.raises(ConfigError, match="1 process, but 2 were launched"):
        check_single_process(DistInfo(rank=0, world_size=2, launcher="torchrun"))


@pytest.mark.gpu
def test_cuda_fp32_and_bf16(dataset: TokenDataset) -> None:
    """GPU twin of the fp32 and bf16 tests: same loop on cuda (AdamW on the device, so compare loosely)."""
    cfg = small_cfg()
    cuda = ReferenceTrainer(cfg, dataset=dataset, device="cuda")
    cpu = ReferenceTrainer(cfg, dataset=dataset, device="cpu")
    for a, b in zip(cuda.run(3), cpu.run(3)):
        assert a.loss == pytest.approx(b.loss, rel=1e-4) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-3)
    bf16 = ReferenceTrainer(small_cfg("bf16"), dataset=dataset, device="cuda")
    results = bf16.run(3)
    assert all(math.isfinite(r.loss) and not r.skipped for r in results)
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    assert torch.cuda.max_memory_allocated() > 0
