"""The tokenizer of ``sysx data prepare``'s sample path: bytes, or a Hugging Face folder through ``transformers``.

A Hugging Face folder (``tokenizer.json`` + ``tokenizer_config.json``) is loaded with
``AutoTokenizer.from_pretrained(..., local_files_only=True)``, so its special tokens (bos, eos, pad)
and its chat template are the model's own; nothing is fetched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sysx.data.errors import DataError
from sysx.data.tokenizer import ByteTokenizer, HFTokenizer

FINETUNE_EXTRA = "pip install 'sysx[finetune]'"


def import_finetune(module: str) -> Any:
    """Import ``datasets`` or ``transformers``, or one line naming the pip extra that installs them."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(
            f"reading instruction data needs the `{module}` package; install it with {FINETUNE_EXTRA}"
        ) from None


class SampleTokenizer:
    """Encodes sample text and renders chats; ``hf`` is a ``transformers`` tokenizer, None for bytes."""

    def __init__(self, hf: Any | None, path: Path | None) -> None:
        self.hf = hf
        self.path = path
        self.vocab_size = len(hf) if hf is not None else ByteTokenizer.vocab_size
        self.eos_id: int | None = hf.eos_token_id if hf is not None else None
        self.bos_id: int | None = hf.bos_token_id if hf is not None else None
        pad = hf.pad_token_id if hf is not None else None
        self.pad_id: int = pad if pad is not None else self.eos_id if self.eos_id is not None else 0

    def encode(self, text: str, *, first: bool = False) -> list[int]:
        """Ids of ``text``; ``first``: it starts a sample, so the tokenizer's own leading tokens (bos) are added."""
        if self.hf is None:
            return list(text.encode("utf-8"))
        return list(self.hf.encode(text, add_special_tokens=first))

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries a chat template (``tokenizer_config.json``'s ``chat_template``)."""
        return self.hf is not None and bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> list[int]:
        """Ids of ``messages`` rendered by the chat template (as ``apply_chat_template`` tokenizes them)."""
        if self.hf is None:
            raise DataError("the byte tokenizer has no chat template; give --tokenizer a Hugging Face folder")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return list(self.hf.encode(text, add_special_tokens=False))

    def describe(self) -> dict[str, Any]:
        """Metadata entry naming the tokenizer (the ``tokenizer.json`` for decoding, as token files do)."""
        if self.hf is None:
            return ByteTokenizer().describe()
        assert self.path is not None
        desc = HFTokenizer(self.path).describe() if self.path.is_file() else {"kind": "hf-folder"}
        return desc | {"vocab_size": self.vocab_size, "eos_id": self.eos_id, "pad_id": self.pad_id}


def load_sample_tokenizer(spec: str | Path) -> SampleTokenizer:
    """``"byte"`` or a Hugging Face tokenizer folder (or its ``tokenizer.json``), loaded locally."""
    if str(spec) == "byte":
        return SampleTokenizer(None, None)
    folder = Path(spec).expanduser()
    if folder.is_file():
        folder = folder.parent
    if not folder.is_dir():
        raise DataError(f"--tokenizer {spec}: no such folder; give a Hugging Face model/tokenizer folder or `byte`")
    transformers = import_finetune("transformers")
    transformers.logging.set_verbosity_error()  # "longer than model_max_length": --max-tokens and seq_len decide
    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/... for a folder it cannot read
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"--tokenizer {folder}: transformers cannot load a tokenizer from it ({first}); "
            "give a folder with tokenizer.json and tokenizer_config.json"
        ) from None
    return SampleTokenizer(hf, (folder / "tokenizer.json").resolve())
