"""Deterministic batches: ``get_batch`` is a pure function of its arguments.

Every sequence of a step has a global row index
``row = (micro_batch * dp_size + dp_rank) * micro_batch_size + b``; its start offset is drawn from
``np.random.default_rng([seed, split_id, step, row])``. So any rank asking for the same
(step, micro_batch, rank layout) gets the same tensors, a resumed run sees exactly the batches it
would have seen, and a step's global batch is the same however it is cut into data-parallel ranks,
micro-batches and rows (e.g. dp_size=2 x 2 micro-batches of 4 == dp_size=1 x 4 micro-batches of 4).
A sample file (``dataset.has_loss_mask``) gives whole samples instead, one per row, in epochs of a
seeded permutation (see :mod:`sysx.data.sample_batch`); it needs ``rows_per_step``.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np

from sysx.data.errors import DataError
from sysx.data.sample_batch import check_samples_fit, sample_rows, step_samples

if TYPE_CHECKING:
    import torch

    from sysx.data.dataset import TokenDataset


def split_id(split: str) -> int:
    """Stable integer id of a split name (CRC-32), mixed into the sampling seed."""
    return zlib.crc32(split.encode("utf-8"))


def sample_offsets(
    num_tokens: int, *, seed: int, step: int, first_row: int, rows: int, seq_len: int, split: str = "train"
) -> np.ndarray:
    """Start offsets (int64) of global rows ``first_row .. first_row+rows-1`` of ``step``."""
    high = num_tokens - seq_len  # offset + seq_len + 1 <= num_tokens
    if high < 1:
        raise DataError(
            f"split {split!r} has {num_tokens} tokens but seq_len={seq_len} needs at least {seq_len + 1}; "
            "use a shorter train.seq_len or more data"
        )
    sid = split_id(split)
    return np.array(
        [np.random.default_rng([seed, sid, step, row]).integers(0, high) for row in range(first_row, first_row + rows)],
        dtype=np.int64,
    )


def batch_host_bytes(rows: int, seq_len: int) -> int:
    """Host bytes :func:`get_batch` holds at once for ``rows`` sequences: the int64 windows of
    ``seq_len + 1`` ids and the inputs and labels copied out of them."""
    return 8 * rows * (seq_len + 1) + 2 * 8 * rows * seq_len


def _check_args(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise DataError(f"get_batch: {name} must be an int, got {value!r}")
    for name in ("seed", "step", "micro_batch", "dp_rank"):
        if values[name] < 0:
            raise DataError(f"get_batch: {name} must be >= 0, got {values[name]}")
    for name in ("micro_batch_size", "seq_len", "dp_size"):
        if values[name] < 1:
            raise DataError(f"get_batch: {name} must be >= 1, got {values[name]}")
    if values["dp_rank"] >= values["dp_size"]:
        raise DataError(f"get_batch: dp_rank must be < dp_size={values['dp_size']}, got {values['dp_rank']}")


def get_batch(
    dataset: TokenDataset,
    *,
    seed: int,
    step: int,
    micro_batch: int,
    micro_batch_size: int,
    seq_len: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    split: str = "train",
    rows_per_step: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels (int64, ``[micro_batch_size, seq_len]``) of one micro-batch; labels = inputs shifted by one.

    A sample file needs ``rows_per_step`` (rows of the step's global batch: micro_batch_size x micro-batches x
    dp_size); its rows are whole samples, right-padded, with label -100 where nothing is trained. A token
    stream ignores it."""
    import torch  # imported here so the data tools (`sysx data ...`) start without loading torch

    _check_args(
        seed=seed,
        step=step,
        micro_batch=micro_batch,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )
    tokens = dataset.split(split)
    first_row = (micro_batch * dp_size + dp_rank) * micro_batch_size
    if dataset.has_loss_mask:
        check_samples_fit(dataset, seq_len=seq_len, split=split)
        samples = step_samples(
            dataset,
            seed=seed,
            step=step,
            first_row=first_row,
            rows=micro_batch_size,
            rows_per_step=rows_per_step,
            split=split,
            split_id=split_id(split),
        )
        inputs, labels = sample_rows(dataset, samples, seq_len)
        return torch.from_numpy(inputs), torch.from_numpy(labels)
    offsets = sample_offsets(
        len(tokens), seed=seed, step=step, first_row=first_row, rows=micro_batch_size, seq_len=seq_len, split=split
    )
    windows = np.stack([np.asarray(tokens[o : o + seq_len + 1], dtype=np.int64) for o in offsets])
    data = torch.from_numpy(windows)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def step_trained_tokens(
    dataset: TokenDataset, *, seed: int, step: int, rows_per_step: int, seq_len: int, split: str = "train"
) -> int | None:
    """Labels != -100 in ``step``'s whole global batch (rows ``0..rows_per_step-1``) of a sample file, from
    its mask and offsets without building the rows; None for a token stream (there every label counts)."""
    if dataset.samples is None:
        return None
    check_samples_fit(dataset, seq_len=seq_len, split=split)
    samples = step_samples(
        dataset,
        seed=seed,
        step=step,
        first_row=0,
        rows=rows_per_step,
        rows_per_step=rows_per_step,
        split=split,
        split_id=split_id(split),
    )
    return int(dataset.samples.targets[samples].sum())
