"""Sequence chunks in the sliding window: a sequence of 512 tokens processed in chunks of 128 and 64
inside each block gives the losses and gradients of the unchunked run (fp32, <= 1e-5) under every
saved-activation level, with blocks sliding (window 1), activations going home and coming back, and
two rounds accumulating gradients; a chunked training run matches the reference trainer; the planner
chooses the chunk length when a sequence's workspace does not fit, and says why."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sysx.config import EvalSection, ModelSection, SingleSection, SysxConfig, TrainSection
from sysx.config.choices import SAVE_LEVELS
from sysx.model import get_preset
from sysx.model.attention import KVCache
from sysx.model.llama import init_layer, make_layer
from sysx.single.hardware import assumed_hardware
from sysx.single.plan_request import PlanError, PlanRequest
from sysx.single.planner import make_plan
from sysx.trainers.reference import ReferenceTrainer
from sysx.trainers.single import SingleTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 512
HW = assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=8)  # planning figures; compute runs on CPU
# 3 blocks, GQA (4 query heads over 2 K/V heads), byte vocabulary: small enough for seconds per run
MODEL = ModelSection(preset="tiny", n_layers=3, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=SEQ)


def make_cfg(steps: int = 1) -> SysxConfig:
    return SysxConfig(
        model=MODEL,
        train=TrainSection(steps=steps, micro_batch_size=1, micro_batches=2, seq_len=SEQ),
        eval=EvalSection(every=0, batches=1),
        device="cpu",
    )


def one_step(policy: str, seq_chunk: int) -> tuple[list[float], dict[int, torch.Tensor], SingleTrainer]:
    """Losses and every group's gradients of one step: 2 rounds of 1 sequence, window 1 (all but the
    last block send their activations home), ``seq_chunk`` tokens per sequence chunk."""
    single = SingleSection(
        window=1, policy=policy, round_sequences=1, micro_batch_size=1, seq_chunk=seq_chunk, print_plan=False
    )
    trainer = SingleTrainer(make_cfg(), single=single, hardware=HW, optimizer_backend="torch")
    grads: dict[int, torch.Tensor] = {}

    def on_grads(group: int, event: object) -> None:
        host = trainer.host.static if group == -1 else trainer.host.groups[group]
        grads[group] = host.grad.clone()

    try:
        plan = trainer.plan
        batches = [trainer.batch(0, j, rows=plan.chunk) for j in range(plan.micro_batches)]
        losses = trainer.executor.run_step(batches, scale=1.0, on_grads=on_grads, before_load=lambda group: None)
    finally:
        trainer.close()
    return [float(v) for v in losses], grads, trainer


_UNCHUNKED: dict[str, tuple[list[float], dict[int, torch.Tensor]]] = {}


def unchunked(policy: str) -> tuple[list[float], dict[int, torch.Tensor]]:
    if policy not in _UNCHUNKED:
        losses, grads, trainer = one_step(policy, SEQ)
        assert trainer.plan.seq_chunks == 1 and trainer.executor.kv is None
        _UNCHUNKED[policy] = (losses, grads)
    return _UNCHUNKED[policy]


@pytest.mark.parametrize("seq_chunk", [128, 64])
@pytest.mark.parametrize("policy", SAVE_LEVELS)
def test_chunked_sequences_give_the_unchunked_losses_and_gradients(policy: str, seq_chunk: int) -> None:
    want_losses, want_grads = unchunked(policy)
    losses, grads, trainer = one_step(policy, seq_chunk)
    plan, stats = trainer.plan, trainer.executor.stats
    assert (plan.seq_chunk, plan.seq_chunks, plan.window, plan.rounds) == (seq_chunk, SEQ // seq_chunk, 1, 2)
    assert plan.r_act == plan.units == SEQ // seq_chunk
    assert stats.d2h_acts > 0 and stats.h2d_acts == stats.d2h_acts  # what went home came back
    assert stats.chunks_backward == 2 * 3 * SEQ // seq_chunk  # rounds x blocks x sequence chunks
    assert max(abs(a - b) / b for a, b in zip(losses, want_losses)) <= 1e-5, (losses, want_losses)
    assert set(grads) == set(want_grads) == {-1, 0, 1, 2}
    worst = {g: float((grads[g] - want).abs().max() / want.abs().max()) for g, want in want_grads.items()}
    assert max(worst.values()) <= 1e-5, worst
    if policy == "everything":
        assert trainer.executor.replay.recomputed_flops == 0.0  # the chunk attention was replayed, not rerun
    if policy == "input":
        assert trainer.executor.replay.reused_sites == 0


def test_a_chunked_training_run_matches_the_reference_trainer() -> None:
    cfg = make_cfg(steps=2)
    ref = ReferenceTrainer(cfg)
    ref_results, ref_state = ref.run(2), ref.state_dict()
    single = SingleSection(window=2, policy="dp", micro_batch_size=1, seq_chunk=128, print_plan=False)
    trainer = SingleTrainer(cfg, single=single, hardware=HW, optimizer_backend="torch")
    try:
        results, state = trainer.run(2), trainer.state_dict()
        assert trainer.plan.seq_chunks == 4
        assert trainer.evaluate() == pytest.approx(ref.evaluate(), rel=1e-5)
    finally:
        trainer.close()
    for a, b in zip(results, ref_results):
        assert abs(a.loss - b.loss) <= 1e-5 * b.loss and abs(a.grad_norm - b.grad_norm) <= 1e-5 * b.grad_norm
    assert max(float((state[k] - v).abs().max() / v.abs().max()) for k, v in ref_state.items()) <= 1e-5


def test_block_chunks_rebuild_the_cache_and_carry_kv_gradients_back() -> None:
    """The model-level contract the executor relies on, on a Block alone: chunk forward equals the whole
    forward; a K/V cache rebuilt from the chunk inputs alone and a reverse pass over the chunks give the
    whole backward's input and parameter gradients."""
    from sysx.config import model_config

    cfg = model_config(make_cfg())
    block = make_layer(cfg, 1)
    init_layer(block, 1, seed=5)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 96, cfg.dim, generator=gen).requires_grad_(True)
    grad_out = torch.randn(2, 96, cfg.dim, generator=gen)
    block(x).backward(grad_out)
    want_x, want_p = x.grad.clone(), {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    shape = (2, cfg.n_kv_heads, 96, cfg.head_dim)
    kv = KVCache(*(torch.full(shape, float("nan")) for _ in range(2)), 0, torch.zeros(shape), torch.zeros(shape))
    with torch.no_grad():
        whole = block(x)
        for j in range(3):
            piece = block(x[:, 32 * j : 32 * (j + 1)], kv.at(32 * j))
            assert (piece - whole[:, 32 * j : 32 * (j + 1)]).abs().max().item() <= 1e-6
    kv.key.fill_(float("nan"))  # the rebuild alone must fill every position a chunk reads
    for j in range(3):
        block.cache_keys_values(x[:, 32 * j : 32 * (j + 1)].detach(), kv.at(32 * j))
    kv.zero_grads()
    grad_x = torch.empty_like(x)
    for j in (2, 1, 0):
        xj = x[:, 32 * j : 32 * (j + 1)].detach().requires_grad_(True)
        block(xj, kv.at(32 * j)).backward(grad_out[:, 32 * j : 32 * (j + 1)])
        grad_x[:, 32 * j : 32 * (j + 1)] = xj.grad
    assert float((grad_x - want_x).abs().max() / want_x.abs().max()) <= 1e-5
    for name, p in block.named_parameters():
        assert float((p.grad - want_p[name]).abs().max() / want_p[name].abs().max()) <= 1e-5, name


# ------------------------------------------------------------------------------------- planner
PLAN_HW = dataclasses.replace(assumed_hardware("rtx4090", host_memory_gib=8), kind="cpu")  # no CUDA reserve
TINY = get_preset("tiny")


def _plan(seq_len: int, budget_mib: float, seq_chunk: int = 0):
    req = PlanRequest(
        model=dataclasses.replace(TINY, max_seq_len=seq_len),
        seq_len=seq_len,
        global_batch=1,
        precision="fp32",
        device_budget_bytes=int(budget_mib * 2**20),
        grad_clip=1.0,
        seq_chunk=seq_chunk,
    )
    return make_plan(req, PLAN_HW)


def test_the_planner_chunks_sequences_only_when_a_whole_one_does_not_fit_and_says_why() -> None:
    roomy = _plan(1024, 1024)
    assert roomy.seq_chunk == 1024 and roomy.seq_chunks == 1
    assert "sequence chunks: none: the workspace of 1 whole sequence(s)" in roomy.render()
    tight = _plan(8192, 64)
    text = tight.render()
    assert tight.seq_chunk < 8192 and 8192 % tight.seq_chunk == 0 and tight.r_act == tight.window * tight.units
    assert f"in {tight.seq_chunks} sequence chunks of {tight.seq_chunk} tokens" in text
    assert "is more than the workspace room" in text and "K/V cache" in text and "K/V grads (fp32)" in text
    assert tight.device_bytes["total"] <= 64 * 2**20
    pinned = _plan(8192, 64, seq_chunk=1024)
    assert pinned.seq_chunk == 1024 and "(single.seq_chunk)" in pinned.render()
    with pytest.raises(PlanError, match=r"single.seq_chunk=1000 must divide train.seq_len=8192"):
        _plan(8192, 64, seq_chunk=1000)


def test_chunks_train_sequences_8x_longer_than_the_unchunked_planner_fits_in_the_same_budget() -> None:
    """Under 64 MiB the longest sequence the planner fits whole (single.seq_chunk = seq_len), on a grid of
    256 tokens, and a sequence 8 times as long planned with automatic chunks."""

    def fits_whole(seq_len: int) -> bool:
        try:
            _plan(seq_len, 64, seq_chunk=seq_len)
            return True
        except PlanError:
            return False

    lo, hi = 256, 65536  # fits, does not fit
    assert fits_whole(lo) and not fits_whole(hi)
    while hi - lo > 256:
        mid = (lo + hi) // 512 * 256
        lo, hi = (mid, hi) if fits_whole(mid) else (lo, mid)
    plan = _plan(8 * lo, 64)
    assert plan.seq_chunks > 1 and plan.device_bytes["total"] <= 64 * 2**20
    print(
        f"\nunder 64 MiB: whole sequences up to {lo} tokens; {8 * lo} tokens in {plan.seq_chunks} chunks of "
        f"{plan.seq_chunk}, window {plan.window}"
    )
