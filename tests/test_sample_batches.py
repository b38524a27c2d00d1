"""Sample files (unpacked samples + loss mask): the writer's files, rows from position 0 with -100 on
padding and untrained tokens, epochs that visit each sample once, global batches independent of how
they are cut, resume at the exact sample, and ``step_trained_tokens`` against counting labels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sysx.data import (
    IGNORE_INDEX,
    DataError,
    SampleWriter,
    TokenDataset,
    check_samples_fit,
    get_batch,
    step_trained_tokens,
)

PAD = 3


def _samples(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` samples of 4..12 ids; the first id of sample i is 100 + i (so rows name their sample);
    the answer (mask 1) is the second half."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(4, 13))
        ids = np.concatenate([[100 + i], rng.integers(10, 90, length - 1)])
        mask = (np.arange(length) >= length // 2).astype(np.uint8)
        out.append((ids, mask))
    return out


def _write(path: Path, samples: list[tuple[np.ndarray, np.ndarray]], val_fraction: float = 0.0) -> TokenDataset:
    with SampleWriter(path, vocab_size=512, tokenizer={"kind": "test"}) as writer:
        for ids, mask in samples:
            writer.write_sample(ids, mask)
        writer.finish(val_fraction=val_fraction, pad_id=PAD)
    return TokenDataset(path)


@pytest.fixture
def samples() -> list[tuple[np.ndarray, np.ndarray]]:
    return _samples(10)


@pytest.fixture
def dataset(tmp_path: Path, samples: list[tuple[np.ndarray, np.ndarray]]) -> TokenDataset:
    return _write(tmp_path / "sft.bin", samples)


def test_writer_files_and_metadata(tmp_path: Path, samples: list[tuple[np.ndarray, np.ndarray]]) -> None:
    ds = _write(tmp_path / "sft.bin", samples, val_fraction=0.2)
    meta = json.loads((tmp_path / "sft.meta.json").read_text())
    lengths = [len(ids) for ids, _ in samples]
    assert meta["kind"] == "samples" and meta["num_samples"] == 10
    assert meta["sample_splits"] == {"train": [0, 8], "val": [8, 10]}
    assert meta["splits"]["val"] == [sum(lengths[:8]), sum(lengths)]
    assert meta["max_sample_tokens"] == max(lengths)
    assert meta["trained_tokens"] == sum(int(m[1:].sum()) for _, m in samples)
    assert (tmp_path / "sft.idx.bin").stat().st_size == 8 * 11
    assert np.array_equal(np.fromfile(tmp_path / "sft.mask.bin", np.uint8)[: lengths[0]], samples[0][1])
    assert ds.has_loss_mask and ds.samples is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft.bin", "sft.idx.bin", "sft.mask.bin", "sft.meta.json"]


def _rows_of(inputs: torch.Tensor) -> list[int]:
    return [int(x) - 100 for x in inputs[:, 0]]


def test_rows_are_whole_samples_from_position_zero(dataset: TokenDataset, samples: list) -> None:
    x, y = get_batch(dataset, seed=1, step=0, micro_batch=0, micro_batch_size=4, seq_len=12, rows_per_step=4)
    assert x.shape == y.shape == (4, 12) and x.dtype == y.dtype == torch.int64
    for row, s in enumerate(_rows_of(x)):
        ids, mask = samples[s]
        n = len(ids)
        assert x[row, :n].tolist() == ids.tolist() and (x[row, n:] == PAD).all()
        expected = [int(ids[t + 1]) if mask[t + 1] else IGNORE_INDEX for t in range(n - 1)]
        assert y[row, : n - 1].tolist() == expected and (y[row, n - 1 :] == IGNORE_INDEX).all()


def test_every_epoch_visits_each_sample_once(dataset: TokenDataset) -> None:
    # 10 samples, 4 rows per step: epochs straddle steps; 5 steps = 2 epochs exactly
    seen = []
    for step in range(5):
        x, _ = get_batch(dataset, seed=7, step=step, micro_batch=0, micro_batch_size=4, seq_len=12, rows_per_step=4)
        seen += _rows_of(x)
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # a new order each epoch
    other = get_batch(dataset, seed=8, step=0, micro_batch=0, micro_batch_size=4, seq_len=12, rows_per_step=4)[0]
    assert _rows_of(other) != seen[:4]  # the seed decides the order


def _global_batch(ds: TokenDataset, step: int, dp_size: int, micro_batches: int, mbs: int) -> torch.Tensor:
    rows = dp_size * micro_batches * mbs
    parts = {}
    for rank in range(dp_size):
        for mb in range(micro_batches):
            x, y = get_batch(
                ds,
                seed=3,
                step=step,
                micro_batch=mb,
                micro_batch_size=mbs,
                seq_len=12,
                dp_rank=rank,
                dp_size=dp_size,
                rows_per_step=rows,
            )
            parts[(mb * dp_size + rank) * mbs] = torch.cat([x, y], dim=1)
    return torch.cat([parts[k] for k in sorted(parts)])


def test_global_batch_independent_of_the_cut_and_resume_is_exact(dataset: TokenDataset) -> None:
    for step in (0, 3):
        reference = _global_batch(dataset, step, 1, 1, 8)
        assert torch.equal(reference, _global_batch(dataset, step, 2, 2, 2))
        assert torch.equal(reference, _global_batch(dataset, step, 4, 1, 2))
        assert torch.equal(reference, _global_batch(dataset, step, 1, 8, 1))
    # a resumed run (a fresh process: a new dataset object, cold caches) sees step 3's exact samples
    again = TokenDataset(dataset.path)
    assert torch.equal(_global_batch(again, 3, 2, 2, 2), _global_batch(dataset, 3, 1, 1, 8))


def test_step_trained_tokens_counts_the_labels(dataset: TokenDataset) -> None:
    for step in range(4):
        _, y = get_batch(dataset, seed=5, step=step, micro_batch=0, micro_batch_size=6, seq_len=16, rows_per_step=6)
        counted = int((y != IGNORE_INDEX).sum())
        assert step_trained_tokens(dataset, seed=5, step=step, rows_per_step=6, seq_len=16) == counted > 0


def test_token_stream_is_unchanged(tmp_path: Path) -> None:
    from sysx.data import TokenWriter

    path = tmp_path / "tokens.bin"
    with TokenWriter(path, vocab_size=256, tokenizer={"kind": "byte"}) as writer:
        writer.write(np.arange(2000) % 256)
        writer.finish()
    ds = TokenDataset(path)
    plain = get_batch(ds, seed=0, step=2, micro_batch=1, micro_batch_size=2, seq_len=8)
    ignored = get_batch(ds, seed=0, step=2, micro_batch=1, micro_batch_size=2, seq_len=8, rows_per_step=99)
    assert not ds.has_loss_mask and all(torch.equal(a, b) for a, b in zip(plain, ignored, strict=True))
    assert torch.equal(plain[1][:, :-1], plain[0][:, 1:])
    assert step_trained_tokens(ds, seed=0, step=0, rows_per_step=4, seq_len=8) is None


def test_sample_batch_errors(dataset: TokenDataset, samples: list) -> None:
    longest = max(len(ids) for ids, _ in samples)
    with pytest.raises(DataError, match="rows_per_step"):
        get_batch(dataset, seed=0, step=0, micro_batch=0, micro_batch_size=2, seq_len=16)
    with pytest.raises(DataError, match="beyond rows_per_step=2"):
        get_batch(dataset, seed=0, step=0, micro_batch=1, micro_batch_size=2, seq_len=16, rows_per_step=2)
    with pytest.raises(DataError) as info:
        get_batch(dataset, seed=0, step=0, micro_batch=0, micro_batch_size=2, seq_len=longest - 2, rows_per_step=2)
    line = str(info.value)
    assert "\n" not in line and f"has {longest} tokens" in line
    assert f"train.seq_len>={longest - 1}" in line and f"--max-tokens {longest - 1}" in line
    check_samples_fit(dataset, seq_len=longest - 1)  # exactly fits: seq_len + 1 tokens
