"""Checks a token file's ids when it is opened: a sample of each split must fit the vocabulary.

A wrong ``dtype`` shows in the values: uint16 ids read as uint32 pair two ids into one
(``lo + 65536 * hi``, far beyond any vocabulary), and uint32 ids read as uint16 put a zero high half
after every id. A sample of evenly spaced windows is enough to see both without reading the file whole.
"""

from __future__ import annotations

import numpy as np

from sysx.data.errors import DataError

SAMPLE_WINDOWS = 64
WINDOW_TOKENS = 4096


def sample_ids(tokens: np.ndarray, *, windows: int = SAMPLE_WINDOWS, window: int = WINDOW_TOKENS) -> np.ndarray:
    """Up to ``windows`` evenly spaced runs of ``window`` ids (the whole array when it is smaller)."""
    n = len(tokens)
    if n <= windows * window:
        return np.asarray(tokens)
    starts = np.linspace(0, n - window, windows).astype(np.int64)
    return np.concatenate([np.asarray(tokens[s : s + window]) for s in starts])


def _looks_like_uint32_as_uint16(ids: np.ndarray) -> bool:
    """Every odd position zero while the even ones are not: the high halves of uint32 ids."""
    even, odd = ids[0::2], ids[1::2]
    return bool(len(odd) >= 64 and not odd.any() and np.count_nonzero(even) > len(even) // 2)


def check_ids(
    tokens: np.ndarray, *, split: str, vocab_size: int, dtype: str, source: str, meta: str | None = None
) -> None:
    """Raise :class:`DataError` when sampled ids of ``split`` do not fit ``vocab_size`` or betray a wrong ``dtype``;
    ``meta`` names the metadata file that gave both (None: they were given as ``data.*`` keys)."""
    ids = sample_ids(tokens)
    if ids.size == 0:
        return
    top = int(ids.max())
    if dtype == "uint32" and top >= 2**16 and top >= vocab_size:
        raise DataError(
            f"data.dtype=uint32 does not match {source}: {split} ids reach {top}, beyond the vocabulary "
            f"({vocab_size}), as uint16 ids read as uint32 do; set data.dtype=uint16"
        )
    if top >= vocab_size and meta is not None:
        raise DataError(
            f"{source} has {split} ids up to {top} but {meta} says vocab_size={vocab_size}: the file or its "
            "metadata is corrupt; rebuild it with `sysx data prepare`"
        )
    if top >= vocab_size:
        raise DataError(
            f"data.vocab_size={vocab_size} is too small for {source}: {split} ids reach {top}; "
            f"set data.vocab_size={top + 1} or larger (the tokenizer's vocabulary size)"
        )
    if dtype == "uint16" and _looks_like_uint32_as_uint16(ids):
        raise DataError(
            f"data.dtype=uint16 does not match {source}: every second {split} id is 0, as uint32 ids "
            "read as uint16 are; set data.dtype=uint32"
        )
