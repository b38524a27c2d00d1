"""Batches of whole samples: one sample per row, from position 0, right-padded, untrained labels -100.

Global row ``g = step * rows_per_step + r`` (``r`` the row within the step's global batch) takes
sample ``perm_e[g % N]`` of epoch ``e = g // N``, where ``perm_e`` is a permutation of the split's
``N`` samples drawn from ``(seed, split, e)``. So every epoch visits every sample once, a step's
global batch does not depend on how it is cut into replicas, micro-batches and rows, and a resumed
run continues at the exact sample: all of it is a pure function of the arguments.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from sysx.data.errors import DataError

if TYPE_CHECKING:
    from sysx.data.dataset import TokenDataset
    from sysx.data.sample_index import SampleIndex

IGNORE_INDEX = -100  # the label of a position that is not trained (PyTorch's and transformers' convention)


@functools.lru_cache(maxsize=8)
def epoch_permutation(num_samples: int, seed: int, split_id: int, epoch: int) -> np.ndarray:
    """The visiting order of epoch ``epoch``: a permutation of ``0..num_samples-1`` (read-only, cached)."""
    perm = np.random.default_rng([seed, split_id, epoch]).permutation(num_samples)
    perm.flags.writeable = False
    return perm


def _index(dataset: TokenDataset) -> SampleIndex:
    if dataset.samples is None:
        raise DataError(f"{dataset.path} is a token stream, not a sample file (`sysx data prepare` makes those)")
    return dataset.samples


def check_samples_fit(dataset: TokenDataset, *, seq_len: int, split: str = "train") -> None:
    """Raise :class:`DataError` when a sample of ``split`` is longer than ``seq_len + 1`` tokens: samples are
    not packed or cut, so a row must hold a whole one. Trainers call this once at start; ``get_batch`` too."""
    index = _index(dataset)
    dataset.split(split)  # the usual error for a split the file lacks
    i, tokens = index.longest(split)
    if tokens > seq_len + 1:
        raise DataError(
            f"sample {i} of {dataset.path} has {tokens} tokens but train.seq_len={seq_len} holds samples of at most "
            f"{seq_len + 1} (samples are not packed or cut); set train.seq_len>={tokens - 1} or prepare again "
            f"with --max-tokens {seq_len + 1}"
        )


def step_samples(
    dataset: TokenDataset,
    *,
    seed: int,
    step: int,
    first_row: int,
    rows: int,
    rows_per_step: int | None,
    split: str,
    split_id: int,
) -> np.ndarray:
    """Sample indices (int64, into the whole file) of global rows ``first_row .. first_row+rows-1`` of ``step``
    (``split_id``: the split's stable id, mixed into the permutations' seed)."""
    if not isinstance(rows_per_step, (int, np.integer)) or isinstance(rows_per_step, bool) or rows_per_step < 1:
        raise DataError(
            f"get_batch: a sample file needs rows_per_step (the global batch's rows per step, >= 1), got {rows_per_step!r}"
        )
    if first_row + rows > rows_per_step:
        raise DataError(
            f"get_batch: rows {first_row}..{first_row + rows - 1} are beyond rows_per_step={rows_per_step}; "
            "rows_per_step must be micro_batch_size * micro-batches * dp_size"
        )
    first, end = _index(dataset).split_range(split)
    n = end - first
    if n < 1:
        raise DataError(f"split {split!r} of {dataset.path} has no samples; prepare it with more rows")
    out = np.empty(rows, dtype=np.int64)
    for k in range(rows):
        epoch, pos = divmod(step * rows_per_step + first_row + k, n)
        out[k] = first + epoch_permutation(n, seed, split_id, epoch)[pos]
    return out


def sample_rows(dataset: TokenDataset, samples: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and labels (int64 ``[len(samples), seq_len]``) of whole samples, one per row from position 0:
    inputs right-padded with the pad id, ``labels[t] = ids[t+1]`` where that token is trained, else -100."""
    index = _index(dataset)
    inputs = np.full((len(samples), seq_len), index.pad_id, dtype=np.int64)
    labels = np.full((len(samples), seq_len), IGNORE_INDEX, dtype=np.int64)
    for row, s in enumerate(samples):
        start, end = int(index.offsets[s]), int(index.offsets[s + 1])
        ids = np.asarray(dataset.tokens[start:end], dtype=np.int64)
        mask = np.asarray(index.mask[start:end], dtype=bool)
        n_in = min(len(ids), seq_len)
        inputs[row, :n_in] = ids[:n_in]
        targets = ids[1 : n_in + 1]
        labels[row, : len(targets)] = np.where(mask[1 : n_in + 1], targets, IGNORE_INDEX)
    return inputs, labels
