"""The loss on instruction data (labels -100 outside the answers) is ``transformers``' loss, on every trainer.

A chat set goes through ``sysx data prepare`` with the tiny HF model's chat template; the first step's
loss of the reference, the single (sliding-window, rows cut into pieces of one) and a 2-rank pipeline
equals ``LlamaForCausalLM(input_ids, labels=...)`` over the step's whole global batch: the mean over its
trained tokens, not a mean of micro-batch means (:mod:`sysx.data.loss_weights`). The chunked loss is
forced to several chunks per row too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SEQ, MBS, N_MB = 96, 2, 2


@pytest.fixture(scope="module")
def sft(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 64-chat instruction set, the tiny HF chat model trained on its text, and its prepared tokens."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import stdlib_instructions
        import tiny_hf_model
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from sysx.data.prepare import main as data_main

    d = tmp_path_factory.mktemp("sft")
    chats = d / "chat.jsonl"
    assert stdlib_instructions.main(["--output", str(chats), "--limit", "64"]) == 0
    assert tiny_hf_model.main(["--text", str(chats), "--output", str(d / "hf")]) == 0
    argv = ["prepare", "--input", str(chats), "--output", str(d / "chat.bin"), "--tokenizer", str(d / "hf")]
    assert data_main([*argv, "--max-tokens", str(SEQ + 1), "--val-fraction", "0.1", "--quiet"]) == 0
    return {"hf": d / "hf", "data": d / "chat.bin"}


def hf_loss(model_dir: Path, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """``LlamaForCausalLM``'s own loss over the rows of ``batches`` (one batch): its labels are the inputs'
    positions, shifted inside, so a row ``x`` with sysx labels ``y`` becomes ``x + [y_last]`` with ``[-100] + y``."""
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float()
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    ids = torch.cat([x, y[:, -1:].clamp_min(0)], dim=1)
    labels = torch.cat([torch.full_like(y[:, :1], -100), y], dim=1)
    with torch.no_grad():
        return float(hf(input_ids=ids, labels=labels).loss)


def _cfg(sft: dict[str, Path]):  # -> SysxConfig (imported lazily)
    from sysx.config import DataSection, EvalSection, ModelSection, SysxConfig, TrainSection

    return SysxConfig(
        model=ModelSection(init_from=str(sft["hf"])),
        data=DataSection(name="file", path=str(sft["data"])),
        train=TrainSection(steps=1, micro_batch_size=MBS, micro_batches=N_MB, seq_len=SEQ),
        eval=EvalSection(every=0),
        device="cpu",
        precision="fp32",
    )


def _step_batches(sft: dict[str, Path], step: int, *, dp_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from sysx.data import TokenDataset, get_batch

    ds = TokenDataset(sft["data"])
    rows = N_MB * MBS * dp_size
    return [
        get_batch(ds, seed=0, step=step, micro_batch=j, micro_batch_size=MBS, seq_len=SEQ, rows_per_step=rows)
        for j in range(N_MB * dp_size)
    ]


def test_the_batches_are_masked_samples(sft: dict[str, Path]) -> None:
    """Each row is one chat from position 0, right-padded; prompts and padding are -100; the
    micro-batches' trained tokens differ (else the weighting below would not be tested)."""
    batches = _step_batches(sft, 0)
    counts = [int((y != -100).sum()) for _, y in batches]
    assert all(c > 0 for c in counts) and len(set(counts)) > 1, counts
    for x, y in batches:
        assert ((y == -100).sum(dim=1) > 0).all()  # the user's turn is never trained
        assert x.shape == y.shape == (MBS, SEQ)


@pytest.mark.parametrize("trainer", ["reference", "single"])
def test_first_step_loss_equals_transformers(
    sft: dict[str, Path], trainer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference computes the loss in one chunk per micro-batch; the single trainer in 7-token chunks
    (~14 per row) over pieces of one row each, so neither the pieces nor the loss chunks are micro-batches."""
    from sysx.config import SingleSection
    from sysx.single.hardware import assumed_hardware
    from sysx.trainers.reference import ReferenceTrainer
    from sysx.trainers.single import SingleTrainer

    cfg = _cfg(sft)
    if trainer == "reference":
        t = ReferenceTrainer(cfg)
    else:
        monkeypatch.setattr("sysx.model.loss.LOSS_CHUNK_TOKENS", 7)
        t = SingleTrainer(
            cfg,
            single=SingleSection(window=1, micro_batch_size=1, print_plan=False),
            hardware=assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=8),
        )
    with t:
        first = t.run(1)[0].loss
    expected = hf_loss(sft["hf"], _step_batches(sft, 0))
    assert abs(first - expected) <= 1e-5, (first, expected)


@pytest.mark.slow
def test_two_rank_pipeline_loss_equals_transformers(sft: dict[str, Path], tmp_path: Path) -> None:
    """SysX and 1F1B on 2 ranks: step 0's loss is transformers' over the global batch; both steps
    match the reference trainer (losses and weights) as every schedule does on token streams."""
    from test_runtime_procs import run_parity

    result = run_parity(
        tmp_path,
        world=2,
        local_world=2,
        model={"init_from": str(sft["hf"])},
        train={"micro_batch_size": MBS, "micro_batches": N_MB, "seq_len": SEQ},
        schedules=[{"schedule": "sysx", "split": 2, "stages_per_rank": 1}, {"schedule": "1f1b"}],
        steps=2,
        data=str(sft["data"]),
    )
    expected = hf_loss(sft["hf"], _step_batches(sft, 0))
    for row in result["rows"]:
        assert abs(row["losses"][0] - expected) <= 1e-5, (row["options"], row["losses"][0], expected)
