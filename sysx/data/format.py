"""The token file format: a flat ``.bin`` of uint16/uint32 ids plus ``<stem>.meta.json`` beside it.

This is nanoGPT's ``.bin`` layout (raw little-endian ids, no header), so its files work as they are;
the JSON adds dtype, vocab size, tokenizer, token count, splits, content hash and source.
Files are published atomically: tokens go to a temp file in the same directory, which replaces the
``.bin`` with ``os.replace``; the metadata is written the same way afterwards, so a reader that finds
the metadata always finds a complete ``.bin``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from sysx.data.errors import DataError

FORMAT_NAME = "sysx-tokens"
FORMAT_VERSION = 1
DTYPES = ("uint16", "uint32")


def dtype_for_vocab(vocab_size: int) -> str:
    """Smallest token dtype holding ids ``0 .. vocab_size-1``: uint16 up to 65536 ids, else uint32."""
    if vocab_size < 1:
        raise DataError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise DataError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


def check_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a token dtype name (little-endian), or a DataError naming the allowed ones."""
    if str(dtype) not in DTYPES:
        raise DataError(f"token dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return np.dtype(str(dtype)).newbyteorder("<")


def meta_path_for(bin_path: Path) -> Path:
    """``train.bin`` -> ``train.meta.json`` (same directory)."""
    return bin_path.with_name(bin_path.stem + ".meta.json")


def create_temp(path: Path) -> tuple[int, Path]:
    """A new, uniquely named temp file beside ``path`` (mode 0666 minus umask, like a plain file); (fd, path)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_meta(bin_path: Path, meta: dict[str, Any]) -> Path:
    """Atomically write ``meta`` as ``<stem>.meta.json`` beside ``bin_path``; returns its path."""
    path = meta_path_for(bin_path)
    _atomic_write_bytes(path, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
    return path


def read_meta(path: Path) -> dict[str, Any]:
    """Read a metadata JSON file, with a clear error if it is not valid JSON or lacks the basics."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read token metadata {path}: {exc}") from exc
    if not isinstance(meta, dict):
        raise DataError(f"token metadata {path} must hold a JSON object, got {type(meta).__name__}")
    return meta


def val_split(num_tokens: int, val_fraction: float) -> dict[str, list[int]]:
    """Split ranges ``{"train": [0, a], "val": [a, n]}``; the last ``val_fraction`` of tokens is val."""
    if not 0.0 <= val_fraction <= 0.5:
        raise DataError(f"val_fraction must be in [0, 0.5], got {val_fraction}")
    n_val = int(num_tokens * val_fraction)
    if val_fraction > 0 and n_val == 0 and num_tokens > 1:
        n_val = 1
    splits = {"train": [0, num_tokens - n_val]}
    if n_val:
        splits["val"] = [num_tokens - n_val, num_tokens]
    return splits


class TokenWriter:
    """Streams token ids into a new token file and publishes it atomically on ``finish``.

    Use as a context manager: leaving the block by an exception removes the temp file and leaves any
    existing file at ``path`` untouched.
    """

    def __init__(
        self, path: str | Path, *, vocab_size: int, tokenizer: dict[str, Any], dtype: str | None = None
    ) -> None:
        self.path = Path(path)
        if self.path.suffix != ".bin":
            raise DataError(f"token file name must end with .bin, got {self.path}")
        self.vocab_size = int(vocab_size)
        self.dtype = dtype or dtype_for_vocab(self.vocab_size)
        self._np_dtype = check_dtype(self.dtype)
        if self.vocab_size - 1 > np.iinfo(self._np_dtype).max:
            raise DataError(f"vocab_size {self.vocab_size} does not fit in {self.dtype}; use uint32")
        self.tokenizer = tokenizer
        self.num_tokens = 0
        self._sha = hashlib.sha256()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = create_temp(self.path)
        self._file = os.fdopen(fd, "wb")

    def write(self, ids: np.ndarray | list[int]) -> None:
        """Append token ids (each must be < vocab_size)."""
        arr = np.asarray(ids)
        if arr.size == 0:
            return
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            raise DataError(f"token id out of range [0, {self.vocab_size}): min {int(arr.min())}, max {int(arr.max())}")
        data = arr.astype(self._np_dtype, copy=False).tobytes()
        self._file.write(data)
        self._sha.update(data)
        self.num_tokens += int(arr.size)

    def finish(self, *, val_fraction: float = 0.0, source: dict[str, Any] | None = None) -> dict[str, Any]:
        """Publish ``<path>`` then ``<stem>.meta.json``; returns the metadata written."""
        if self.num_tokens == 0:
            self.abort()
            raise DataError(f"no tokens to write to {self.path}: the input corpus is empty")
        return self._publish(val_split(self.num_tokens, val_fraction), source or {})

    def _publish(self, splits: dict[str, list[int]], source: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """Close the tokens, publish them (companion files first) and then the metadata (``extra`` merged in)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "num_tokens": self.num_tokens,
            "splits": splits,
            "sha256": self._sha.hexdigest(),
            "tokenizer": self.tokenizer,
            "source": source,
        } | extra
        meta_path_for(self.path).unlink(missing_ok=True)  # never pair a new .bin with stale metadata
        self._publish_companions()
        os.replace(self._tmp, self.path)
        write_meta(self.path, meta)
        return meta

    def _publish_companions(self) -> None:
        """Files that belong with the tokens (a subclass's), moved into place before the tokens are."""

    def abort(self) -> None:
        """Drop the temp file; the destination is left as it was."""
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None or self._tmp.exists():
            self.abort()
