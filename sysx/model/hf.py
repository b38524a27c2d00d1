"""Import and export Hugging Face ``LlamaForCausalLM`` weights (safetensors; no transformers needed).

``load_hf_llama(src)`` takes a local HF directory (``config.json`` + ``model.safetensors`` or a
sharded ``model.safetensors.index.json``) or a pair ``(config, state_dict)`` where ``config`` is
an HF ``LlamaConfig`` (anything with ``to_dict()``) or the ``config.json`` dict. ``export_hf_llama``
writes a directory that ``LlamaForCausalLM.from_pretrained`` loads. Only what sysx computes is
accepted: SiLU, no biases, ``head_dim == hidden / heads``, RoPE ``default`` or ``llama3`` (the Llama-3.1
scaling: ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``),
read from ``rope_scaling`` (transformers 4.x) or ``rope_parameters`` (5.x) and written to both.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from sysx.model.config import ModelConfig
from sysx.model.llama import LlamaModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_IGNORED_HF_KEYS = ("model.rotary_emb.inv_freq",)
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Per-Block parameter names: sysx (inside layers.<i>) -> HF (inside model.layers.<i-1>).
_BLOCK_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def hf_key_map(cfg: ModelConfig) -> dict[str, str]:
    """sysx parameter name (``LlamaModel.named_parameters``) -> HF ``LlamaForCausalLM`` key.

    A tied output projection has no entry of its own (HF files leave ``lm_head.weight`` out).
    """
    last = cfg.n_layers + 1
    keys = {"layers.0.weight": "model.embed_tokens.weight"}
    for i in range(cfg.n_layers):
        for ours, theirs in _BLOCK_KEYS.items():
            keys[f"layers.{i + 1}.{ours}"] = f"model.layers.{i}.{theirs}"
    keys[f"layers.{last}.norm.weight"] = "model.norm.weight"
    if not cfg.tie_embeddings:
        keys[f"layers.{last}.lm_head.weight"] = "lm_head.weight"
    return keys


def _unsupported(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"HF Llama config: {key}={value!r} is not supported by sysx (supported: {allowed})")


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Translate an HF Llama ``config.json`` dict (transformers 4.x or 5.x layout) to a ModelConfig."""
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    absent = [key for key in required if key not in hf]
    if absent:
        raise ValueError(f"HF Llama config lacks {absent}; is this a LlamaForCausalLM config.json?")
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise _unsupported("model_type", model_type, "'llama'")
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", hf["hidden_act"], "'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            raise _unsupported(key, hf[key], "false")
    if hf.get("attention_dropout") or 0.0:
        raise _unsupported("attention_dropout", hf["attention_dropout"], "0.0")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != hf["hidden_size"] // heads:
        raise _unsupported("head_dim", head_dim, f"hidden_size // num_attention_heads = {hf['hidden_size'] // heads}")
    rope = _rope_from_hf(hf)
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_dim=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **rope,
    )


# HF llama3 rope keys -> ModelConfig fields
_LLAMA3_KEYS = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_len",
}


def _rope_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE fields of a ModelConfig from ``rope_theta`` and ``rope_scaling`` / ``rope_parameters``."""
    out: dict[str, Any] = {"rope_theta": float(hf.get("rope_theta", 10000.0))}
    for key in ("rope_scaling", "rope_parameters"):  # transformers 4.x / 5.x names
        rope = hf.get(key) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise _unsupported(f"{key}.rope_type", rope_type, "'default' (plain RoPE) or 'llama3' (Llama-3.1 scaling)")
        if "rope_theta" in rope:
            out["rope_theta"] = float(rope["rope_theta"])
        if rope_type == "llama3":
            absent = [k for k in _LLAMA3_KEYS if k != "original_max_position_embeddings" and k not in rope]
            if absent:
                raise ValueError(f"HF Llama config: {key} of rope_type 'llama3' lacks {absent}")
            # transformers falls back to max_position_embeddings when the original length is not given
            original = rope.get("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
            out.update(
                rope_type="llama3",
                rope_factor=float(rope["factor"]),
                rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_max_len=int(original),
            )
    return out


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling`` (4.x) and ``rope_parameters`` (5.x) of ``cfg``."""
    scaling = None
    if cfg.rope_type == "llama3":
        scaling = {"rope_type": "llama3", **{theirs: getattr(cfg, ours) for theirs, ours in _LLAMA3_KEYS.items()}}
    parameters = {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` dict of ``cfg`` (readable by transformers 4.x and 5.x)."""
    dtype_name = {v: k for k, v in _DTYPE_NAMES.items()}[dtype]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        **_rope_to_hf(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


def hf_weight_files(root: Path) -> dict[str, Path]:
    """Every weight key of an HF directory -> the safetensors file holding it (headers only are read)."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (root / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in root.iterdir())
        raise FileNotFoundError(
            f"{root}: no safetensors weights ({WEIGHTS_FILE} or {INDEX_FILE}); found {found}. "
            f"sysx reads safetensors only: re-save with save_pretrained(..., safe_serialization=True)"
        )
    where: dict[str, Path] = {}
    for name in files:
        path = root / name
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safetensors' safe_open has no __iter__
                    where[key] = path
        except SafetensorError as err:  # a download cut short: the header promises more bytes than there are
            raise ValueError(
                f"{path} is not a complete safetensors file ({err}); it is truncated or damaged: "
                f"download or copy it again"
            ) from None
    return where


class SafetensorsFiles:
    """Lazy ``key -> tensor`` access to a set of safetensors files (an HF directory, a sysx model file)."""

    def __init__(self, where: Mapping[str, Path]) -> None:
        self._where = dict(where)

    def keys(self) -> list[str]:
        return list(self._where)

    def items(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self._where[key], []).append(key)
        for path, file_keys in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for key in file_keys:
                    yield key, f.get_tensor(key)


class _DictTensors:
    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._sd = state_dict

    def keys(self) -> list[str]:
        return list(self._sd)

    def items(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for key in keys:
            yield key, self._sd[key]


def _open_source(src: Any) -> tuple[ModelConfig, SafetensorsFiles | _DictTensors]:
    if isinstance(src, (str, os.PathLike)):
        root = Path(src)
        if not root.is_dir():
            raise FileNotFoundError(
                f"load_hf_llama: {root} is not a directory (expected an HF model dir with {CONFIG_FILE})"
            )
        config_path = root / CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(
                f"load_hf_llama: {config_path} does not exist; is {root} a Hugging Face model directory?"
            )
        return config_from_hf(json.loads(config_path.read_text())), SafetensorsFiles(hf_weight_files(root))
    if isinstance(src, tuple) and len(src) == 2:
        config, state_dict = src
        hf = config if isinstance(config, Mapping) else config.to_dict()
        return config_from_hf(hf), _DictTensors(state_dict)
    raise TypeError(
        f"load_hf_llama: src must be an HF directory path or a (LlamaConfig, state_dict) pair, got {type(src).__name__}"
    )


@torch.no_grad()
def load_hf_llama(src: Any, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> LlamaModel:
    """Build a sysx :class:`LlamaModel` holding the weights of an HF ``LlamaForCausalLM``.

    ``dtype`` defaults to the dtype of the stored embedding. Missing, unexpected or misshapen
    tensors are a clear error.
    """
    cfg, tensors = _open_source(src)
    key_map = hf_key_map(cfg)
    wanted = set(key_map.values())
    present = set(tensors.keys())
    missing = sorted(wanted - present)
    if missing:
        raise ValueError(f"load_hf_llama: {len(missing)} weight(s) missing, e.g. {missing[:5]}")
    ignorable = set(_IGNORED_HF_KEYS) | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    unexpected = sorted(present - wanted - ignorable)
    if unexpected:
        raise ValueError(
            f"load_hf_llama: {len(unexpected)} unexpected weight(s) for a Llama model, e.g. {unexpected[:5]}"
        )
    if dtype is None:
        dtype = next(t for _, t in tensors.items(["model.embed_tokens.weight"])).dtype
    model = LlamaModel(cfg, dtype=dtype, device=device)
    params = dict(model.named_parameters())
    ours_of = {theirs: ours for ours, theirs in key_map.items()}
    for key, tensor in tensors.items(sorted(wanted)):
        param = params[ours_of[key]]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"load_hf_llama: {key} has shape {tuple(tensor.shape)}, the config implies {tuple(param.shape)}"
            )
        param.copy_(tensor)
    return model


def export_hf_llama(
    model: LlamaModel,
    dst_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer_dir: str | os.PathLike | None = None,
    token_ids: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model`` as an HF directory (``config.json`` + safetensors, sharded above 5 GiB), plus the
    tokenizer files found in ``tokenizer_dir``; every file is readable by the user's group.
    ``token_ids`` (``bos_token_id``, ``eos_token_id``, ...) go into ``config.json``."""
    cfg = model.config
    dtype = dtype or model.embedding.weight.dtype
    if dtype not in _DTYPE_NAMES.values():
        raise ValueError(f"export_hf_llama: dtype {dtype} not supported; use one of {list(_DTYPE_NAMES)}")
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters(remove_duplicate=False))
    key_map = hf_key_map(cfg)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for ours in key_map:
        nbytes = params[ours].numel() * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(ours)
        size += nbytes
    names = (
        [WEIGHTS_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for name, shard in zip(names, shards):
        # Copies: parameters may be views of one flat buffer, which safetensors refuses to save.
        tensors = {key_map[o]: params[o].detach().to("cpu", dtype, copy=True).contiguous() for o in shard}
        save_file(tensors, str(dst / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    if len(shards) == 1 and (dst / INDEX_FILE).exists():
        (dst / INDEX_FILE).unlink()  # a stale index of an earlier sharded export would shadow the new file
    if len(shards) > 1:
        total = sum(params[o].numel() for o in key_map) * itemsize
        (dst / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    (dst / CONFIG_FILE).write_text(json.dumps(config_to_hf(cfg, dtype) | dict(token_ids or {}), indent=2) + "\n")
    if tokenizer_dir is not None:
        for src in sorted(Path(tokenizer_dir).iterdir()):
            if src.is_file():
                shutil.copyfile(src, dst / src.name)
    for path in [dst, *dst.iterdir()]:
        path.chmod(path.stat().st_mode | stat.S_IRGRP | (stat.S_IXGRP if path.is_dir() else 0))
    return dst
