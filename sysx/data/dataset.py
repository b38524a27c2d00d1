"""``TokenDataset``: a memory-mapped token file (nanoGPT ``.bin`` layout) and its splits.

Where the metadata comes from, first match wins:
1. ``<stem>.meta.json`` beside the ``.bin`` (written by ``sysx data prepare``): dtype, vocab size,
   tokenizer, splits as token ranges of the one file;
2. ``meta.json`` in the same directory (dtype, vocab size, tokenizer for every ``.bin`` there);
3. nanoGPT's ``meta.pkl`` in the same directory (``vocab_size``, char ``itos``; nanoGPT writes uint16);
4. the ``dtype`` / ``vocab_size`` arguments (required when none of the above exists).
Without split ranges, a ``train.bin`` with a ``val.bin`` beside it (nanoGPT's layout) gives the
``train`` and ``val`` splits; otherwise the whole file is ``train``. Tokens are never read whole.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from sysx.data.errors import DataError
from sysx.data.format import check_dtype, meta_path_for, read_meta
from sysx.data.sample_format import SAMPLES_KIND
from sysx.data.sample_index import SampleIndex
from sysx.data.sanity import check_ids
from sysx.data.tokenizer import ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer


class _MetaUnpickler(pickle.Unpickler):
    """Unpickles plain data only (nanoGPT's meta.pkl is dicts of ints and strs); refuses any class."""

    def find_class(self, module: str, name: str) -> Any:
        raise DataError(f"meta.pkl refers to {module}.{name}; only plain dicts/ints/strs are read")


def read_nanogpt_meta(path: Path) -> dict[str, Any]:
    """Read nanoGPT's ``meta.pkl`` without executing code."""
    try:
        with open(path, "rb") as f:
            meta = _MetaUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        raise DataError(f"cannot read nanoGPT metadata {path}: {exc}") from exc
    if not isinstance(meta, dict) or "vocab_size" not in meta:
        raise DataError(f"nanoGPT metadata {path} has no 'vocab_size' entry")
    return meta


def _memmap(path: Path, dtype: np.dtype, meta: Path | None = None) -> np.memmap:
    """``path`` as read-only ids; ``meta`` names the metadata that gave ``dtype`` (None: the user gave it)."""
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"token file {path} is empty; rebuild it with `sysx data prepare`")
    if size % dtype.itemsize and meta is not None:
        raise DataError(
            f"token file {path} has {size} bytes, not a multiple of {dtype.itemsize} ({dtype.name} per "
            f"{meta}): the file is truncated; rebuild it with `sysx data prepare`"
        )
    if size % 2:
        raise DataError(
            f"token file {path} has {size} bytes, an odd count no token dtype fits (data.dtype={dtype.name}): "
            "the file is truncated; rebuild it"
        )
    if size % dtype.itemsize:
        raise DataError(
            f"token file {path} has {size} bytes, not a multiple of {dtype.itemsize}: "
            f"data.dtype={dtype.name} is wrong (try data.dtype=uint16) or the file is truncated"
        )
    try:
        return np.memmap(path, dtype=dtype, mode="r")
    except OSError as exc:
        raise DataError(
            f"cannot read token file {path}: {exc.strerror or exc}; check data.path and its permissions"
        ) from None


class TokenDataset:
    """A token file opened read-only as a memmap: ``.tokens``, ``.vocab_size``, ``.dtype``, splits."""

    def __init__(self, path: str | Path, *, dtype: str | None = None, vocab_size: int | None = None) -> None:
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "train.bin"
        if not path.is_file():
            raise DataError(
                f"token file not found: {path}; build one with `sysx data prepare --input ... --output {path}`"
            )
        self.path = path
        self.meta, self.meta_source = self._find_meta(path)
        self.dtype = self._resolve("dtype", dtype, self.meta.get("dtype"))
        vocab = self._resolve("vocab_size", vocab_size, self.meta.get("vocab_size"))
        self.vocab_size = int(vocab)
        self._np_dtype = check_dtype(self.dtype)
        self.tokens: np.memmap = _memmap(path, self._np_dtype, self.meta_source)
        expected = self.meta.get("num_tokens") if self.meta_source == meta_path_for(path) else None
        if expected is not None and int(expected) != len(self.tokens):
            raise DataError(
                f"{path} holds {len(self.tokens)} tokens but {self.meta_source} says {expected}: "
                "the file is truncated or does not belong to this metadata; rebuild it"
            )
        self._splits = self._find_splits()
        own_meta = self.meta_source == meta_path_for(path)
        self.samples: SampleIndex | None = (
            SampleIndex(path, self.meta, len(self.tokens))
            if own_meta and self.meta.get("kind") == SAMPLES_KIND
            else None
        )
        meta = str(self.meta_source) if self.meta_source is not None and vocab_size is None else None
        for name, ids in self._splits.items():
            check_ids(ids, split=name, vocab_size=self.vocab_size, dtype=self.dtype, source=str(path), meta=meta)

    def _find_meta(self, path: Path) -> tuple[dict[str, Any], Path | None]:
        own = meta_path_for(path)
        if own.is_file():
            return read_meta(own), own
        shared = path.parent / "meta.json"
        if shared.is_file():
            meta = read_meta(shared)
            meta.pop("splits", None)  # ranges in a shared file cannot refer to this particular .bin
            meta.pop("num_tokens", None)
            return meta, shared
        pkl = path.parent / "meta.pkl"
        if pkl.is_file():
            nano = read_nanogpt_meta(pkl)
            meta = {"dtype": "uint16", "vocab_size": int(nano["vocab_size"])}
            if isinstance(nano.get("itos"), dict):
                meta["tokenizer"] = {"kind": "nanogpt-char", "itos": nano["itos"]}
            return meta, pkl
        return {}, None

    def _resolve(self, key: str, given: Any, found: Any) -> Any:
        if given is not None and found is not None and str(given) != str(found):
            raise DataError(
                f"data.{key}={given} contradicts {self.meta_source}, which says {key}={found} for "
                f"{self.path}; drop data.{key} or set data.{key}={found}"
            )
        value = given if given is not None else found
        if value is None:
            hint = "data.dtype=uint16 (nanoGPT's default)" if key == "dtype" else "data.vocab_size=50257 for GPT-2 ids"
            raise DataError(
                f"{self.path} has no metadata ({meta_path_for(self.path).name}, meta.json or meta.pkl) giving {key}; "
                f"set it, e.g. {hint}, or write the file with `sysx data prepare`"
            )
        return value

    def _find_splits(self) -> dict[str, np.ndarray]:
        n = len(self.tokens)
        ranges = self.meta.get("splits") if self.meta_source == meta_path_for(self.path) else None
        if ranges:
            splits = {}
            for name, (start, end) in ranges.items():
                if not 0 <= int(start) <= int(end) <= n:
                    raise DataError(f"split {name!r} range [{start}, {end}) of {self.meta_source} is outside 0..{n}")
                splits[name] = self.tokens[int(start) : int(end)]
            return splits
        splits = {"train": self.tokens[:]}
        sibling = self.path.with_name("val.bin")
        if self.path.name == "train.bin" and sibling.is_file():
            splits["val"] = _memmap(sibling, self._np_dtype, self.meta_source)
        return splits

    @property
    def has_loss_mask(self) -> bool:
        """True for a sample file (unpacked samples with a loss mask), False for a flat token stream."""
        return self.samples is not None

    @property
    def splits(self) -> list[str]:
        """Names of the available splits."""
        return list(self._splits)

    def split(self, name: str) -> np.ndarray:
        """The tokens of split ``name`` (a memmap view; nothing is read yet)."""
        if name not in self._splits:
            raise DataError(
                f"{self.path} has no {name!r} split (it has: {', '.join(self._splits)}); "
                "rebuild it with `sysx data prepare --val-fraction 0.01` or put a val.bin beside train.bin"
            )
        return self._splits[name]

    def carve_val(self, fraction: float, min_tokens: int) -> int:
        """Make a ``val`` split of the last ``fraction`` of ``train`` (at least ``min_tokens``) when the
        file has none, as nanoGPT files without ``val.bin`` need for evaluation; returns its token count
        (0 when a val split exists). A sample file carves whole samples (their token count is returned)."""
        if "val" in self._splits:
            return 0
        if self.samples is not None:
            self.samples.carve_val(fraction)
            (first, cut), (_, end) = self.samples.ranges["train"], self.samples.ranges["val"]
            offsets = self.samples.offsets
            self._splits["train"] = self.tokens[int(offsets[first]) : int(offsets[cut])]
            self._splits["val"] = self.tokens[int(offsets[cut]) : int(offsets[end])]
            return len(self._splits["val"])
        train = self._splits["train"]
        n_val = max(int(len(train) * fraction), min_tokens)
        if 2 * n_val > len(train):
            raise DataError(
                f"{self.path} has {len(train)} tokens and no val split, too few to carve {n_val} val tokens "
                "from its end; set eval.every=0 or give it a val split (`sysx data prepare --val-fraction 0.01`)"
            )
        self._splits["train"], self._splits["val"] = train[: len(train) - n_val], train[len(train) - n_val :]
        return n_val

    def __len__(self) -> int:
        return len(self.tokens)

    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer named by the metadata, for decoding; None if unknown or unavailable."""
        desc = self.meta.get("tokenizer") or {}
        kind = desc.get("kind")
        if kind == "byte":
            return ByteTokenizer()
        if kind == "nanogpt-char":
            return CharTokenizer(desc["itos"])
        if kind == "hf" and Path(desc.get("path", "")).is_file():
            return HFTokenizer(desc["path"])
        return None

    def max_token(self, chunk: int = 1 << 24) -> int:
        """Largest id in the file, scanned in chunks (reads the whole file once, never holds it)."""
        return max(int(self.tokens[i : i + chunk].max()) for i in range(0, len(self.tokens), chunk))

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.path)!r}, tokens={len(self)}, dtype={self.dtype}, vocab_size={self.vocab_size})"
