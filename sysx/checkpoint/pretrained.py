"""Pretrained weights, read one flat layer at a time (``model.init_from``), and the job's model shape.

:func:`open_pretrained` takes a Hugging Face Llama folder (``config.json`` + ``model.safetensors``
or shards with their index), a sysx model file, or a sysx checkpoint (folder or checkpoint dir),
and returns a :class:`PretrainedWeights`: the model shape plus ``layer(i)``, the tensors of flat
layer ``i`` under sysx's parameter names. Only the requested layer is read (safetensors files are
memory-mapped), so owners that fill their host buffers layer by layer never hold the model twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from sysx.checkpoint.reader import find_resume
from sysx.checkpoint.store import MANIFEST, CheckpointDir, CheckpointError
from sysx.config import ConfigError, SysxConfig
from sysx.config.checks import first_line
from sysx.config.schema import check_seq_len, model_config
from sysx.data.tokenizer import kept_tokenizer_dir, same_tokenizer
from sysx.model import llama
from sysx.model.config import ModelConfig
from sysx.model.hf import CONFIG_FILE, SafetensorsFiles, config_from_hf, hf_key_map, hf_weight_files
from sysx.model.io import read_model_config
from sysx.model.layers import Head
from sysx.model.llama import LayerInit, LlamaModel

if TYPE_CHECKING:
    from sysx.data.dataset import TokenDataset


class PretrainedWeights:
    """A model shape and lazy per-layer access to its weights (see the module doc)."""

    def __init__(self, source: str, config: ModelConfig, layer: Callable[[int], dict[str, torch.Tensor]]) -> None:
        self.source = source
        self.config = config
        self._layer = layer

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """Tensors of flat layer ``index`` by sysx name (``layers.<index>.<param>``), in the stored dtype."""
        return self._layer(index)


def _layers_of(
    source: str, files: SafetensorsFiles, key_map: Mapping[str, str]
) -> Callable[[int], dict[str, torch.Tensor]]:
    """Per-layer reads through ``key_map`` (sysx name -> stored key)."""
    grouped: dict[int, dict[str, str]] = {}
    for ours, stored in key_map.items():
        grouped.setdefault(int(ours.split(".")[1]), {})[ours] = stored
    present = set(files.keys())

    def layer(index: int) -> dict[str, torch.Tensor]:
        names = grouped.get(index, {})
        missing = sorted(stored for stored in names.values() if stored not in present)
        if missing:
            raise ValueError(f"{source}: flat layer {index} lacks {missing[:3]}")
        theirs = {stored: ours for ours, stored in names.items()}
        return {theirs[key]: tensor for key, tensor in files.items(list(theirs))}

    return layer


def open_pretrained(path: str | os.PathLike) -> PretrainedWeights:
    """Open an HF Llama folder, a sysx model file or a sysx checkpoint (one clear error otherwise)."""
    root = Path(path)
    if root.is_dir() and (root / CONFIG_FILE).is_file():
        cfg = config_from_hf(json.loads((root / CONFIG_FILE).read_text()))
        return PretrainedWeights(
            str(root), cfg, _layers_of(str(root), SafetensorsFiles(hf_weight_files(root)), hf_key_map(cfg))
        )
    if root.is_dir():
        if not (root / MANIFEST).is_file() and CheckpointDir(root).latest() is None:
            found = sorted(p.name for p in root.iterdir())[:8]
            raise FileNotFoundError(
                f"{root} has no {CONFIG_FILE} (a Hugging Face Llama folder) and no complete sysx checkpoint "
                f"(step-<N>/{MANIFEST}); found {found}; give a Hugging Face folder with {CONFIG_FILE}, "
                f"a sysx model file or a sysx checkpoint"
            )
        ckpt = find_resume(str(root), root)
        assert ckpt is not None  # a manifest or a latest checkpoint is there
        return PretrainedWeights(
            str(ckpt.path), ModelConfig.from_dict(ckpt.model), lambda index: ckpt.layer(index).weight
        )
    if root.is_file():
        cfg = read_model_config(root)
        with safe_open(str(root), framework="pt") as f:
            keys = list(f.keys())
        return PretrainedWeights(
            str(root), cfg, _layers_of(str(root), SafetensorsFiles({k: root for k in keys}), {k: k for k in keys})
        )
    raise FileNotFoundError(
        f"{path} does not exist; give a Hugging Face Llama folder "
        f"(config.json + *.safetensors), a sysx model file or a sysx checkpoint"
    )


def job_model_config(cfg: SysxConfig) -> ModelConfig:
    """The job's model shape: :func:`sysx.config.model_config`, with ``model.init_from`` the shape of
    those weights (read here: config checks values, never files). A folder that cannot be read, a
    field set to another value or a ``train.seq_len`` over the weights' ``max_seq_len`` is a
    one-line :class:`~sysx.config.ConfigError`."""
    init_from = cfg.model.init_from
    if init_from is None:
        return model_config(cfg)
    try:
        shape = open_pretrained(str(init_from)).config
    except (OSError, ValueError, CheckpointError) as err:
        raise ConfigError(f"model.init_from={init_from}: {first_line(err)}") from None
    resolved = model_config(cfg, pretrained=shape)
    check_seq_len(cfg, resolved)
    return resolved


def check_data_tokenizer(cfg: SysxConfig, dataset: TokenDataset) -> None:
    """The data must be tokenized with ``model.init_from``'s tokenizer (``tokenizer.json`` beside the
    weights) when both are known: otherwise every id means another token. A :class:`ConfigError` naming the fix."""
    if cfg.model.init_from is None:
        return
    tokenizer_json = Path(cfg.model.init_from) / "tokenizer.json"
    if not tokenizer_json.is_file():
        return  # the weights name no tokenizer
    kept = kept_tokenizer_dir(dataset.path) / "tokenizer.json"
    if same_tokenizer(dataset.meta.get("tokenizer") or {}, tokenizer_json, kept) is not False:
        return
    data = "data=default (the byte-level corpus)" if cfg.data.name == "default" else f"data.path={cfg.data.path}"
    raise ConfigError(
        f"model.init_from={cfg.model.init_from} has its own tokenizer ({tokenizer_json}) but {data} was "
        f"tokenized with another, so its ids mean other tokens; tokenize the text with the model's: "
        f"sysx data prepare --input <texts> --output data/ft.bin --tokenizer {cfg.model.init_from}, then "
        f"data=file data.path=data/ft.bin"
    )


def pretrained_init(weights: PretrainedWeights) -> LayerInit:
    """A :data:`sysx.model.llama.LayerInit` that fills flat layer ``i`` from ``weights.layer(i)``
    (read only then, so builders stream the model layer by layer)."""

    @torch.no_grad()
    def init(layer: nn.Module, index: int) -> None:
        tensors = weights.layer(index)
        own = {f"layers.{index}.{name}": p for name, p in layer.named_parameters()}
        if isinstance(layer, Head) and layer.tied_to_embedding:
            own.pop(f"layers.{index}.lm_head.weight")  # the Embedding (layer 0) holds the tied weight
        missing = sorted(set(own) - set(tensors))
        extra = sorted(set(tensors) - set(own))
        if missing or extra:
            raise ValueError(
                f"{weights.source}: flat layer {index} does not match the model: missing {missing[:3]}, "
                f"unexpected {extra[:3]}"
            )
        for name, param in own.items():
            if tuple(tensors[name].shape) != tuple(param.shape):
                raise ValueError(
                    f"{weights.source}: {name} has shape {tuple(tensors[name].shape)}, the model needs "
                    f"{tuple(param.shape)}"
                )
            param.copy_(tensors[name])

    return init


def build_model(weights: PretrainedWeights, *, dtype: torch.dtype | None = None) -> LlamaModel:
    """A whole :class:`LlamaModel` holding ``weights`` (for export and inspection; training streams
    layers into its own buffers instead). ``dtype`` defaults to the stored one."""
    dtype = dtype or next(iter(weights.layer(0).values())).dtype
    return llama.build_model(weights.config, dtype=dtype, init=pretrained_init(weights))
