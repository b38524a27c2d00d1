"""The sysx model-weights file: one safetensors file whose metadata holds the ModelConfig.

Tensor names are ``LlamaModel.named_parameters()`` names (a tied output projection is stored
once, as the embedding). Metadata: ``format = "sysx.model"``, ``format_version = "1"``,
``config = ModelConfig.to_json()``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from sysx.model.config import ModelConfig
from sysx.model.llama import LlamaModel

FORMAT = "sysx.model"
FORMAT_VERSION = "1"


def save_model(model: LlamaModel, path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> Path:
    """Write ``model``'s weights and config to ``path`` (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Copies: parameters may be views of one flat buffer, which safetensors refuses to save.
    tensors = {
        name: p.detach().to("cpu", dtype or p.dtype, copy=True).contiguous() for name, p in model.named_parameters()
    }
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": model.config.to_json()}
    save_file(tensors, str(path), metadata=metadata)
    return path


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig stored in a sysx model file (clear errors for a missing or foreign file)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sysx model file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"{path} is not a safetensors file ({err}); expected a file written by sysx save_model"
        ) from err
    if metadata.get("format") != FORMAT:
        raise ValueError(
            f"{path} is a safetensors file but not a sysx model file (metadata format={metadata.get('format')!r}, "
            f"expected {FORMAT!r}); for a Hugging Face directory use load_hf_llama / `sysx convert --from-hf`"
        )
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: sysx model format version {metadata.get('format_version')!r} is not supported "
            f"(this sysx reads version {FORMAT_VERSION})"
        )
    return ModelConfig.from_json(metadata["config"])


@torch.no_grad()
def load_model(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> LlamaModel:
    """Read a file written by :func:`save_model`; ``dtype`` defaults to the stored one."""
    path = Path(path)
    cfg = read_model_config(path)
    with safe_open(str(path), framework="pt") as f:
        stored = set(f.keys())
        if dtype is None:
            stored_dtype = f.get_slice("layers.0.weight").get_dtype() if "layers.0.weight" in stored else "F32"
            dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(
                stored_dtype, torch.float32
            )
        model = LlamaModel(cfg, dtype=dtype, device=device)
        params = dict(model.named_parameters())
        missing = sorted(set(params) - stored)
        unexpected = sorted(stored - set(params))
        if missing or unexpected:
            raise ValueError(
                f"{path}: tensors do not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, param in params.items():
            tensor = f.get_tensor(name)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"{path}: {name} has shape {tuple(tensor.shape)}, the config implies {tuple(param.shape)}"
                )
            param.copy_(tensor)
    return model
