"""Tokenizers for token files: the byte-level default and a local Hugging Face ``tokenizer.json``.

``tokenizers`` (Hugging Face) is imported only when a ``tokenizer.json`` is loaded, so sysx imports
without it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Protocol

from sysx.data.errors import DataError

# Special tokens commonly used to end a document, tried in this order by ``HFTokenizer.eos_id``.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
# Likewise for the start of a document (``HFTokenizer.bos_id``).
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")


class Tokenizer(Protocol):
    """What sysx needs from a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def describe(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no special tokens, lossless for any text."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: its UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; invalid UTF-8 (e.g. a sample cut mid-character) becomes U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        """Metadata entry naming this tokenizer."""
        return {"kind": "byte", "vocab_size": self.vocab_size}


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - tokenizers ships with transformers here
        raise DataError(
            "reading a tokenizer.json needs the Hugging Face `tokenizers` package; "
            "install it with `pip install tokenizers` or use `--tokenizer byte`"
        ) from exc
    return tokenizers


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# What `transformers.AutoTokenizer.from_pretrained` reads from a model folder (those present are kept).
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # names the special tokens (bos_token, eos_token, pad_token)
TOKENIZER_FILES = ("tokenizer.json", TOKENIZER_CONFIG_FILE, "special_tokens_map.json", "tokenizer.model")


def kept_tokenizer_dir(tokens_path: str | Path) -> Path:
    """Where ``sysx data prepare --tokenizer`` keeps the tokenizer's files beside ``<stem>.bin``."""
    path = Path(tokens_path)
    return path.with_name(f"{path.stem}.tokenizer")


def keep_tokenizer_files(tokenizer_json: Path, tokens_path: str | Path) -> Path:
    """Copy the tokenizer's files (``TOKENIZER_FILES`` beside ``tokenizer_json``) beside the tokens,
    so an exported model carries the tokenizer it was trained with. Returns the folder."""
    dst = kept_tokenizer_dir(tokens_path)
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = tokenizer_json.parent / name
        if src.is_file():
            shutil.copyfile(src, dst / name)
    return dst


def same_tokenizer(desc: dict[str, Any], tokenizer_json: Path, kept: Path | None = None) -> bool | None:
    """Whether ``tokenizer_json`` is the tokenizer a token file's metadata ``desc`` names: by content
    hash, else by vocabulary (read from ``kept``, the copy kept beside the tokens, or ``desc``'s path),
    else by vocabulary size. None when ``desc`` names no tokenizer (a file without metadata)."""
    kind = desc.get("kind")
    if kind is None:
        return None
    if kind != "hf":
        return False  # byte or nanoGPT characters: never a tokenizer.json's ids
    if desc.get("sha256") == file_sha256(tokenizer_json):
        return True
    theirs = _vocab(tokenizer_json)
    for source in (kept, Path(desc.get("path", ""))):
        if source is not None and source.is_file():
            return _vocab(source) == theirs
    return desc.get("vocab_size") == len(theirs)


def _vocab(tokenizer_json: Path) -> dict[str, int]:
    """Token -> id of a ``tokenizer.json``: the model's vocabulary and the added tokens."""
    data = json.loads(tokenizer_json.read_text())
    vocab = dict((data.get("model") or {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in data.get("added_tokens") or []})
    return vocab


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from a local ``tokenizer.json``."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"tokenizer file not found: {path}; give a tokenizer.json (or its directory) or `byte`")
        tokenizers = _import_tokenizers()
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a plain Exception on bad JSON
            raise DataError(f"cannot read tokenizer {path}: {exc}") from exc
        self.path = path.resolve()
        self.vocab_size: int = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens kept, so document ends stay visible)."""
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None if the vocabulary lacks it."""
        found = self._tok.token_to_id(token)
        return None if found is None else int(found)

    def eos_id(self) -> int | None:
        """Id of the first end-of-document special token found (see ``EOS_CANDIDATES``), else None."""
        return self._first_known(EOS_CANDIDATES)

    def bos_id(self) -> int | None:
        """Id of the first begin-of-document special token found (see ``BOS_CANDIDATES``), else None."""
        return self._first_known(BOS_CANDIDATES)

    def _first_known(self, tokens: tuple[str, ...]) -> int | None:
        for token in tokens:
            found = self.token_to_id(token)
            if found is not None:
                return found
        return None

    def describe(self) -> dict[str, Any]:
        """Metadata entry naming this tokenizer (path and content hash)."""
        return {"kind": "hf", "path": str(self.path), "sha256": file_sha256(self.path), "vocab_size": self.vocab_size}


class CharTokenizer:
    """nanoGPT's character-level tokenizer from ``meta.pkl`` (``itos``/``stoi``), for decoding samples."""

    def __init__(self, itos: dict[int, str]) -> None:
        self.itos = {int(k): str(v) for k, v in itos.items()}
        self.stoi = {v: k for k, v in self.itos.items()}
        self.vocab_size = len(self.itos)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; every character must be in the vocabulary."""
        missing = sorted({c for c in text if c not in self.stoi})
        if missing:
            raise DataError(f"characters not in the meta.pkl vocabulary: {missing[:10]!r}")
        return [self.stoi[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; unknown ids become U+FFFD."""
        return "".join(self.itos.get(int(i), "\ufffd") for i in ids)

    def describe(self) -> dict[str, Any]:
        """Metadata entry naming this tokenizer."""
        return {"kind": "nanogpt-char", "vocab_size": self.vocab_size}


def load_tokenizer(spec: str | Path) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` gives the byte-level tokenizer; anything else is a path to a ``tokenizer.json`` (or its dir)."""
    if str(spec) == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
