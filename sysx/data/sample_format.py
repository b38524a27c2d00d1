"""The sample file format: unpacked training samples (prompt + answer) with a per-token loss mask.

Beside the nanoGPT-layout ``<stem>.bin`` (the samples' tokens, concatenated, so every token tool
still reads it) a sample file has ``<stem>.mask.bin`` (uint8 per token, 1 = the token is a training
target) and ``<stem>.idx.bin`` (int64, N+1 offsets: sample i is tokens ``[idx[i], idx[i+1])``).
The metadata says ``"kind": "samples"`` and holds the sample ranges of the splits. A sample's first
token is never a target (nothing precedes it), so its mask bit is always 0 and the mask's sum is
the number of labels a whole epoch trains. All three files are published before the metadata, as
:class:`~sysx.data.format.TokenWriter` does, so a reader that finds the metadata finds them complete.
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from sysx.data.errors import DataError
from sysx.data.format import TokenWriter, create_temp, val_split

SAMPLES_KIND = "samples"
MASK_DTYPE = np.dtype("uint8")
OFFSET_DTYPE = np.dtype("<i8")


def mask_path_for(bin_path: Path) -> Path:
    """``train.bin`` -> ``train.mask.bin``: the per-token loss mask."""
    return bin_path.with_name(bin_path.stem + ".mask.bin")


def index_path_for(bin_path: Path) -> Path:
    """``train.bin`` -> ``train.idx.bin``: the N+1 sample offsets."""
    return bin_path.with_name(bin_path.stem + ".idx.bin")


class SampleWriter(TokenWriter):
    """Streams samples (token ids + loss mask) into a new sample file; publishes all files on ``finish``."""

    def __init__(
        self, path: str | Path, *, vocab_size: int, tokenizer: dict[str, Any], dtype: str | None = None
    ) -> None:
        super().__init__(path, vocab_size=vocab_size, tokenizer=tokenizer, dtype=dtype)
        fd, self._mask_tmp = create_temp(mask_path_for(self.path))
        self._mask_file = os.fdopen(fd, "wb")
        self._offsets = array("q", [0])
        self.trained_tokens = 0
        self.max_sample_tokens = 0

    def __enter__(self) -> SampleWriter:
        return self

    @property
    def num_samples(self) -> int:
        """Samples written so far."""
        return len(self._offsets) - 1

    def write_sample(self, ids: list[int] | np.ndarray, mask: list[int] | np.ndarray) -> None:
        """Append one sample: its ids and a 0/1 mask of the same length (1 = train on this token)."""
        ids = np.asarray(ids, dtype=np.int64)
        bits = np.asarray(mask, dtype=MASK_DTYPE).copy()
        if ids.ndim != 1 or ids.size == 0 or bits.shape != ids.shape:
            raise DataError(f"a sample needs >= 1 ids and a mask of the same length, got {ids.shape} and {bits.shape}")
        if bits.max() > 1:
            raise DataError(f"a loss mask holds 0 and 1 only, got {int(bits.max())}")
        bits[0] = 0  # the first token has no predecessor: never a target
        self.write(ids)
        self._mask_file.write(bits.tobytes())
        self._offsets.append(self.num_tokens)
        self.trained_tokens += int(bits.sum())
        self.max_sample_tokens = max(self.max_sample_tokens, int(ids.size))

    def finish(
        self, *, val_fraction: float = 0.0, source: dict[str, Any] | None = None, **extra: Any
    ) -> dict[str, Any]:
        """Publish mask, offsets, tokens, then the metadata (``extra`` keys added); returns the metadata."""
        if self.num_samples == 0:
            self.abort()
            raise DataError(f"no samples to write to {self.path}: every input row was empty or bad")
        ranges = val_split(self.num_samples, val_fraction)  # over samples: the last fraction is val
        token_splits = {name: [self._offsets[a], self._offsets[b]] for name, (a, b) in ranges.items()}
        self._mask_file.flush()
        os.fsync(self._mask_file.fileno())
        self._mask_file.close()
        fd, self._index_tmp = create_temp(index_path_for(self.path))
        with os.fdopen(fd, "wb") as f:
            f.write(np.frombuffer(self._offsets, dtype=np.int64).astype(OFFSET_DTYPE).tobytes())
            f.flush()
            os.fsync(f.fileno())
        return self._publish(
            token_splits,
            source or {},
            kind=SAMPLES_KIND,
            num_samples=self.num_samples,
            sample_splits=ranges,
            max_sample_tokens=self.max_sample_tokens,
            trained_tokens=self.trained_tokens,
            **extra,
        )

    def _publish_companions(self) -> None:
        os.replace(self._mask_tmp, mask_path_for(self.path))
        os.replace(self._index_tmp, index_path_for(self.path))

    def abort(self) -> None:
        """Drop every temp file; the destination files are left as they were."""
        super().abort()
        if not self._mask_file.closed:
            self._mask_file.close()
        self._mask_tmp.unlink(missing_ok=True)
        index_tmp = getattr(self, "_index_tmp", None)
        if index_tmp is not None:
            index_tmp.unlink(missing_ok=True)
