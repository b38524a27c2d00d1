"""The special-token ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) an exported Hugging
Face ``config.json`` carries: ``generate()`` stops at the end-of-text token only when the config
names it. They come from the source model's ``config.json`` (``model.init_from`` a Hugging Face
folder, or the one a checkpoint's run started from), else from the tokenizer's files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sysx.checkpoint.reader import Checkpoint, find_resume
from sysx.checkpoint.store import CheckpointError
from sysx.config import ConfigError, from_yaml
from sysx.data.tokenizer import TOKENIZER_CONFIG_FILE, HFTokenizer
from sysx.model.hf import CONFIG_FILE

TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def source_token_ids(source: str | Path | None) -> dict[str, Any]:
    """The special-token ids in the ``config.json`` of ``source`` (a Hugging Face folder), or of the
    folder a sysx checkpoint's run was started from (``model.init_from``); {} when there is none."""
    if source is None:
        return {}
    root = Path(source)
    if root.is_dir() and (root / CONFIG_FILE).is_file():
        hf = json.loads((root / CONFIG_FILE).read_text(encoding="utf-8"))
        return {k: hf[k] for k in TOKEN_ID_KEYS if hf.get(k) is not None}
    if not root.is_dir():
        return {}
    try:
        ckpt: Checkpoint | None = find_resume(str(root), root)
        init_from = from_yaml(ckpt.trainer_state()["config"]).model.init_from if ckpt is not None else None
    except (CheckpointError, ConfigError, KeyError, OSError):
        return {}  # no run configuration recorded: the tokenizer decides
    return source_token_ids(init_from) if init_from is not None and Path(init_from) != root else {}


def tokenizer_token_ids(tokenizer_dir: str | Path | None) -> dict[str, Any]:
    """The special-token ids a tokenizer folder names: its ``tokenizer_config.json``'s ``bos_token``,
    ``eos_token`` and ``pad_token``, else the usual begin- and end-of-text tokens of its vocabulary."""
    if tokenizer_dir is None or not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        return {}
    tok = HFTokenizer(tokenizer_dir)
    named: dict[str, Any] = {}
    settings = Path(tokenizer_dir) / TOKENIZER_CONFIG_FILE
    if settings.is_file():
        named = json.loads(settings.read_text(encoding="utf-8"))
    ids: dict[str, Any] = {}
    for key in TOKEN_ID_KEYS:
        token = named.get(key.removesuffix("_id"))
        if isinstance(token, dict):  # {"content": "<s>", ...} in older transformers
            token = token.get("content")
        found = tok.token_to_id(token) if isinstance(token, str) else None
        if found is not None:
            ids[key] = found
    ids.setdefault("bos_token_id", tok.bos_id())
    ids.setdefault("eos_token_id", tok.eos_id())
    return {k: v for k, v in ids.items() if v is not None}


def export_token_ids(source: str | Path | None, tokenizer_dir: str | Path | None) -> dict[str, Any]:
    """What an export writes: the source model's ids, completed from the tokenizer's."""
    return tokenizer_token_ids(tokenizer_dir) | source_token_ids(source)
