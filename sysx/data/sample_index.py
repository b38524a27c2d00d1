"""``SampleIndex``: the samples of a sample file (see :mod:`sysx.data.sample_format`), read-only.

It memory-maps the loss mask and the offsets beside a token file, checks that they belong to it,
and answers what the sampler asks per split: how many samples, where sample i lies, how long the
longest one is and how many targets each has (both computed once, on first use).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from sysx.data.errors import DataError
from sysx.data.format import val_split
from sysx.data.sample_format import MASK_DTYPE, OFFSET_DTYPE, index_path_for, mask_path_for


def _open(path: Path, dtype: np.dtype, count: int, what: str) -> np.memmap:
    if not path.is_file():
        raise DataError(f"{what} {path} is missing; rebuild the sample file with `sysx data prepare`")
    if path.stat().st_size != count * dtype.itemsize:
        raise DataError(
            f"{what} {path} has {path.stat().st_size} bytes, not {count * dtype.itemsize}: the file is truncated "
            "or belongs to another token file; rebuild it with `sysx data prepare`"
        )
    return np.memmap(path, dtype=dtype, mode="r")


class SampleIndex:
    """Offsets, loss mask and split ranges of the samples of ``bin_path`` (``meta`` is its metadata)."""

    def __init__(self, bin_path: Path, meta: dict[str, Any], num_tokens: int) -> None:
        self.num_samples = int(meta.get("num_samples", 0))
        self.mask = _open(mask_path_for(bin_path), MASK_DTYPE, num_tokens, "loss mask")
        self.offsets = _open(index_path_for(bin_path), OFFSET_DTYPE, self.num_samples + 1, "sample offsets")
        if self.num_samples < 1 or self.offsets[0] != 0 or self.offsets[-1] != num_tokens:
            raise DataError(f"sample offsets {index_path_for(bin_path)} do not span {bin_path}; rebuild it")
        self.pad_id = int(meta.get("pad_id", 0))
        self.ranges: dict[str, tuple[int, int]] = {}
        self._longest: dict[str, tuple[int, int]] = {}
        for name, (start, end) in (meta.get("sample_splits") or {"train": [0, self.num_samples]}).items():
            if not 0 <= int(start) <= int(end) <= self.num_samples:
                raise DataError(
                    f"sample split {name!r} [{start}, {end}) of {bin_path} is outside 0..{self.num_samples}"
                )
            self.ranges[name] = (int(start), int(end))

    def split_range(self, split: str) -> tuple[int, int]:
        """``(first, end)`` sample indices of ``split``."""
        return self.ranges[split]

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """Tokens per sample (int64, one per sample)."""
        return np.diff(np.asarray(self.offsets))

    @functools.cached_property
    def targets(self) -> np.ndarray:
        """Loss targets per sample (int64): the sum of its mask bits (the first token's is always 0)."""
        return np.add.reduceat(self.mask, np.asarray(self.offsets[:-1]), dtype=np.int64)

    def longest(self, split: str) -> tuple[int, int]:
        """``(sample index, tokens)`` of the longest sample of ``split`` (the first such)."""
        if split not in self._longest:
            first, end = self.split_range(split)
            i = first + int(np.argmax(self.lengths[first:end])) if end > first else first
            self._longest[split] = (i, int(self.lengths[i]) if end > first else 0)
        return self._longest[split]

    def carve_val(self, fraction: float) -> int:
        """Make a ``val`` split of the last ``fraction`` of the train samples when there is none; returns
        its sample count (0 when a val split exists)."""
        if "val" in self.ranges:
            return 0
        first, end = self.ranges["train"]
        carved = val_split(end - first, fraction)
        if "val" not in carved or 2 * (carved["val"][1] - carved["val"][0]) > end - first:
            raise DataError(
                f"{end - first} train samples and no val split: too few to carve a val split; set eval.every=0 "
                "or prepare the file with --val-fraction 0.01"
            )
        cut = first + carved["train"][1]
        self.ranges["train"], self.ranges["val"] = (first, cut), (cut, end)
        self._longest.clear()
        return end - cut
