"""Text in and out of ``sysx generate``: the tokenizer, the chat template, and the terminal stream.

A folder goes through ``transformers``' ``AutoTokenizer`` when it is installed (extra ``finetune``): that
is what renders the model's chat template (``tokenizer_config.json``) and adds the special tokens the
model expects. Without ``transformers``, or for a plain ``tokenizer.json``, sysx's own
:class:`~sysx.data.tokenizer.HFTokenizer` encodes (no chat template then); ``byte`` is the byte-level
tokenizer of the default corpus.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from sysx.data.errors import DataError
from sysx.data.sample_tokenizer import load_sample_tokenizer
from sysx.data.tokenizer import ByteTokenizer, HFTokenizer
from sysx.generate import GenerateError
from sysx.generate.source import BYTE

REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence


@dataclass(frozen=True)
class PromptTokenizer:
    """Encode a raw prompt or a chat, decode for display, and the ids that end a reply."""

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    chat: Callable[[list[dict[str, str]]], list[int]] | None
    eos_ids: tuple[int, ...]

    def chat_ids(self, user: str, system: str | None = None) -> list[int]:
        """Ids of a user message (after an optional system message) in the chat template, ending with
        the assistant's turn opened (``add_generation_prompt``)."""
        if self.chat is None:
            raise GenerateError(
                f"--chat needs a chat template but the tokenizer {self.name} has none (tokenizer_config.json "
                f"chat_template, read through transformers: pip install 'sysx[finetune]'); use --prompt with "
                f"the raw text, or --tokenizer a folder that has a chat template"
            )
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return self.chat(messages)


def _auto_tokenizer(folder: Path) -> PromptTokenizer:
    """The folder through ``transformers``, rendered exactly as ``sysx data prepare`` renders training chats."""
    tok = load_sample_tokenizer(folder)
    hf: Any = tok.hf  # a folder, never "byte": a transformers tokenizer

    def chat(messages: list[dict[str, str]]) -> list[int]:
        return tok.render_chat(list(messages), add_generation_prompt=True)

    return PromptTokenizer(
        name=str(folder),
        encode=lambda text: tok.encode(text, first=True),
        decode=lambda ids: str(hf.decode(list(ids), skip_special_tokens=True)),
        chat=chat if tok.has_chat_template else None,
        eos_ids=() if tok.eos_id is None else (int(tok.eos_id),),
    )


def _sysx_tokenizer(path: Path) -> PromptTokenizer:
    tok = HFTokenizer(path)
    eos = tok.eos_id()
    return PromptTokenizer(
        str(tok.path), tok.encode, lambda ids: tok.decode(list(ids)), None, () if eos is None else (eos,)
    )


def load_prompt_tokenizer(spec: str) -> PromptTokenizer:
    """``byte``, a tokenizer folder, or a ``tokenizer.json`` (see the module doc)."""
    if spec == BYTE:
        byte = ByteTokenizer()
        return PromptTokenizer(BYTE, byte.encode, lambda ids: byte.decode(list(ids)), None, ())
    path = Path(spec).expanduser()
    if not path.exists():
        raise GenerateError(
            f"--tokenizer {spec}: no such file or folder; give the model's folder (tokenizer.json, "
            f"tokenizer_config.json), a tokenizer.json, or byte"
        )
    try:
        if path.is_dir() and importlib.util.find_spec("transformers") is not None:
            return _auto_tokenizer(path)
        return _sysx_tokenizer(path)
    except (OSError, ValueError, DataError) as err:
        message = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise GenerateError(
            f"--tokenizer {spec}: cannot be read ({message}); give the model's folder or its tokenizer.json"
        ) from None


class TextStream:
    """Print a reply as its tokens arrive. The whole reply is decoded each time and only the new text
    is written, held back while it ends in an incomplete UTF-8 sequence, so a character split over
    several byte tokens prints once, whole."""

    def __init__(self, decode: Callable[[Sequence[int]], str], out: TextIO | None = None) -> None:
        self._decode = decode
        self._out = out if out is not None else sys.stdout
        self.ids: list[int] = []
        self.printed = ""

    def push(self, token: int) -> None:
        """Add one token and print what it completes."""
        self.ids.append(token)
        text = self._decode(self.ids)
        if not text.endswith(REPLACEMENT):
            self._write(text)

    def end(self) -> str:
        """Print the rest (an unfinished character as U+FFFD) and a newline; returns the whole reply."""
        self._write(self._decode(self.ids))
        self._out.write("\n")
        self._out.flush()
        return self.printed

    def _write(self, text: str) -> None:
        if text.startswith(self.printed):
            self._out.write(text[len(self.printed) :])
        else:  # a decoder that rewrote earlier text (a merge across tokens): print from the change on
            common = next((i for i, (a, b) in enumerate(zip(text, self.printed)) if a != b), len(self.printed))
            self._out.write(text[common:])
        self._out.flush()
        self.printed = text
