"""What ``sysx generate --model PATH`` names, and which tokenizer goes with it.

A Hugging Face Llama folder carries its tokenizer and its ``eos_token_id``. A sysx run directory,
checkpoint dir or checkpoint carries the run's configuration (``config.yaml``, or the copy in the
checkpoint's trainer state), which names the tokenizer: ``model.init_from``'s folder, the tokenizer
``sysx data prepare`` kept beside the token file, or the byte tokenizer of the default corpus. A
sysx model file names none (``--tokenizer`` then).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError

from sysx.checkpoint.pretrained import PretrainedWeights, open_pretrained
from sysx.checkpoint.reader import Checkpoint, find_resume
from sysx.checkpoint.store import MANIFEST, CheckpointDir, CheckpointError
from sysx.config import ConfigError, SysxConfig
from sysx.config.checks import first_line
from sysx.config.compose import from_yaml
from sysx.data.errors import DataError
from sysx.data.format import meta_path_for, read_meta
from sysx.data.tokenizer import TOKENIZER_FILES, kept_tokenizer_dir
from sysx.generate import GenerateError
from sysx.model.hf import CONFIG_FILE
from sysx.run_dir import CONFIG_FILE as RUN_CONFIG_FILE

GENERATION_CONFIG_FILE = "generation_config.json"
BYTE = "byte"  # the tokenizer spec of the byte-level default corpus


@dataclass(frozen=True)
class ModelSource:
    """The weights ``--model`` names, the tokenizer found with them (a folder, ``byte``, or None),
    the end-of-sequence ids its config names, and where the weights were read from."""

    weights: PretrainedWeights
    tokenizer: str | None
    eos_ids: tuple[int, ...]
    where: str


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _config_eos(folder: Path) -> tuple[int, ...]:
    """``eos_token_id`` (an int or a list) of a Hugging Face folder's ``config.json`` and
    ``generation_config.json`` (where instruct models name their end-of-turn tokens), else none."""
    found: list[int] = []
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):
        if (folder / name).is_file():
            eos = json.loads((folder / name).read_text()).get("eos_token_id")
            found += [] if eos is None else [int(i) for i in (eos if isinstance(eos, list) else [eos])]
    return tuple(dict.fromkeys(found))


def run_tokenizer(cfg: SysxConfig) -> str | None:
    """The tokenizer a run trained with: ``model.init_from``'s folder, the folder ``sysx data prepare``
    kept beside the token file (or the one its metadata names), ``byte`` for the default corpus, else None."""
    if cfg.model.init_from is not None and _has_tokenizer(Path(cfg.model.init_from)):
        return str(cfg.model.init_from)
    if cfg.data.name == "default":
        return BYTE
    if cfg.data.path is None:
        return None
    kept = kept_tokenizer_dir(cfg.data.path)
    if _has_tokenizer(kept):
        return str(kept)
    meta_file = meta_path_for(Path(cfg.data.path))
    desc = (read_meta(meta_file).get("tokenizer") or {}) if meta_file.is_file() else {}
    if desc.get("kind") == "byte":
        return BYTE
    named = Path(str(desc.get("path", "")))
    return str(named.parent) if desc.get("kind") == "hf" and named.is_file() else None


def _checkpoint_of(root: Path) -> Checkpoint:
    """The checkpoint a run directory, a checkpoint dir or a checkpoint folder names."""
    if (root / MANIFEST).is_file():
        return Checkpoint(root)
    candidates = [root]
    if (root / RUN_CONFIG_FILE).is_file():  # a run directory: its checkpoints, wherever checkpoint.dir put them
        cfg = from_yaml((root / RUN_CONFIG_FILE).read_text())
        candidates = [root / "checkpoints", Path(cfg.checkpoint_dir)]
    for folder in candidates:
        if CheckpointDir(folder).latest() is not None:
            ckpt = find_resume(str(folder), folder)
            assert ckpt is not None  # a latest checkpoint is there
            return ckpt
    found = sorted(p.name for p in root.iterdir())[:8]
    raise GenerateError(
        f"--model {root}: no {CONFIG_FILE} (a Hugging Face Llama folder) and no complete sysx checkpoint "
        f"(step-<N>/{MANIFEST}) there; found {found}; give a Hugging Face folder, a run directory with a "
        f"checkpoint, a checkpoint or a sysx model file"
    )


def _open(path: Path) -> ModelSource:
    if not path.exists():
        raise GenerateError(
            f"--model {path}: no such file or folder; give a Hugging Face Llama folder, a sysx run directory, "
            f"checkpoint or model file"
        )
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        tokenizer = str(path) if _has_tokenizer(path) else None
        return ModelSource(open_pretrained(path), tokenizer, _config_eos(path), str(path))
    if path.is_file():
        return ModelSource(open_pretrained(path), None, (), str(path))
    ckpt = _checkpoint_of(path)
    cfg = from_yaml(ckpt.trainer_state()["config"])
    return ModelSource(open_pretrained(ckpt.path), run_tokenizer(cfg), (), f"{ckpt.path} (step {ckpt.step})")


def open_source(path: str | Path) -> ModelSource:
    """Open what ``--model`` names; anything unreadable is a :class:`GenerateError` in one line."""
    try:
        return _open(Path(path).expanduser())
    except GenerateError:
        raise
    except (OSError, ValueError, CheckpointError, SafetensorError, KeyError) as err:
        if isinstance(err, (ConfigError, DataError)):
            raise GenerateError(f"--model {path}: the run's configuration: {first_line(err)}") from None
        raise GenerateError(
            f"--model {path}: not a model sysx can read ({first_line(err)}); give a Hugging Face Llama "
            f"folder, a sysx run directory, checkpoint or model file"
        ) from None
