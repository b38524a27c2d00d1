"""One input row -> one sample (ids + loss mask), in the three shapes ``sysx data prepare`` reads.

- ``text``: a pretraining document; every token is trained.
- ``prompt-completion``: the prompt's tokens are not trained, the completion's (and the eos after it) are.
- ``chat``: a ``messages`` list rendered by the tokenizer's chat template; only assistant turns are
  trained (see :mod:`sysx.data.chat_mask`).
A row that cannot become a sample raises :class:`~sysx.data.chat_mask.BadRow`; ``BadRows`` counts
them per kind for the one-line-per-kind report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sysx.data.chat_mask import BadRow, chat_sample
from sysx.data.errors import DataError
from sysx.data.sample_tokenizer import SampleTokenizer

FORMATS = ("auto", "text", "prompt-completion", "chat")


@dataclass(frozen=True)
class Fields:
    """Column names of the three shapes (``--text-field`` etc.)."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"

    def needed(self, fmt: str) -> list[str]:
        """The columns format ``fmt`` reads."""
        return {"text": [self.text], "prompt-completion": [self.prompt, self.completion], "chat": [self.messages]}[fmt]


def resolve_format(fmt: str, columns: list[str], fields: Fields) -> str:
    """The shape to read: ``fmt`` itself, or for ``auto`` the first whose columns exist (chat,
    prompt-completion, text). An explicit shape must find its columns."""
    if fmt not in FORMATS:
        raise DataError(f"--format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    have = ", ".join(columns) or "none"
    if fmt == "auto":
        for candidate in ("chat", "prompt-completion", "text"):
            if all(c in columns for c in fields.needed(candidate)):
                return candidate
        raise DataError(
            f"--format auto finds no messages, prompt/completion or text column among the data's columns ({have}); "
            "name yours with --messages-field, --prompt-field/--completion-field or --text-field"
        )
    missing = [c for c in fields.needed(fmt) if c not in columns]
    if missing:
        option = {fields.text: "--text-field", fields.prompt: "--prompt-field", fields.messages: "--messages-field"}
        flag = option.get(missing[0], "--completion-field")
        raise DataError(f"--format {fmt} needs a column {missing[0]!r}; the data has ({have}): set {flag}")
    return fmt


def _text(row: dict[str, Any], name: str) -> str:
    value = row.get(name)
    if value is None:
        raise BadRow(f"missing field {name!r}")
    if not isinstance(value, str):
        raise BadRow(f"field {name!r} not text")
    _check_utf8(value)
    return value


def _check_utf8(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. a JSON "\ud800" escape: no UTF-8 exists for them
        raise BadRow("bad UTF-8") from None


def _messages(row: dict[str, Any], name: str) -> list[dict[str, Any]]:
    messages = row.get(name)
    if messages is None:
        raise BadRow(f"missing field {name!r}")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise BadRow("messages not a list of {role, content} texts")
    for m in messages:
        _check_utf8(m["content"])
        if m["role"] == "assistant" and not m["content"].strip():
            raise BadRow("empty answer")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def row_sample(row: dict[str, Any], fmt: str, fields: Fields, tok: SampleTokenizer) -> tuple[list[int], np.ndarray]:
    """The ids and loss mask of one row in shape ``fmt`` (not ``auto``); raises BadRow."""
    eos = [tok.eos_id] if tok.eos_id is not None else []
    if fmt == "chat":
        return chat_sample(tok, _messages(row, fields.messages))
    if fmt == "text":
        text = _text(row, fields.text)
        if not text.strip():
            raise BadRow("empty text")
        ids = tok.encode(text, first=True) + eos
        return ids, np.ones(len(ids), dtype=np.uint8)
    prompt, completion = _text(row, fields.prompt), _text(row, fields.completion)
    if not completion.strip():
        raise BadRow("empty answer")
    head, tail = tok.encode(prompt, first=True), tok.encode(completion) + eos
    return head + tail, np.concatenate([np.zeros(len(head), np.uint8), np.ones(len(tail), np.uint8)])


@dataclass
class BadRows:
    """Bad rows per kind: count and first row number (rows count from 1 in input order)."""

    kinds: dict[str, list[int]] = field(default_factory=dict)

    def add(self, kind: str, row: int) -> None:
        """Note one bad row of ``kind``."""
        entry = self.kinds.setdefault(kind, [0, row])
        entry[0] += 1
        entry[1] = min(entry[1], row)

    @property
    def total(self) -> int:
        """Bad rows of every kind."""
        return sum(count for count, _ in self.kinds.values())

    def lines(self) -> list[str]:
        """One line per kind, most frequent first: ``"12 rows skipped: empty answer (first: row 7)"``."""
        ordered = sorted(self.kinds.items(), key=lambda kv: (-kv[1][0], kv[0]))
        return [f"{n} row{'s' * (n != 1)} skipped: {kind} (first: row {first})" for kind, (n, first) in ordered]
