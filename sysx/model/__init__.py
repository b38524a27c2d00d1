"""Llama-2/3 as a flat list of layers ``[Embedding, Block x L, Head]``, numerically equal to
Hugging Face ``LlamaForCausalLM``; flat per-stage parameter buffers; presets; FLOP counts;
HF import/export and the sysx model-weights file."""

from sysx.model.config import PRESETS, ModelConfig, choose_n_heads, get_preset
from sysx.model.flat import FlatEntry, FlatLayout
from sysx.model.flops import flops_per_token, layer_flops, param_count
from sysx.model.hf import export_hf_llama, load_hf_llama
from sysx.model.io import load_model, save_model
from sysx.model.layers import MLP, Attention, Block, Embedding, Head, RMSNorm
from sysx.model.llama import LlamaModel, build_layers, build_model, run_layers

__all__ = [
    "MLP",
    "PRESETS",
    "Attention",
    "Block",
    "Embedding",
    "FlatEntry",
    "FlatLayout",
    "Head",
    "LlamaModel",
    "ModelConfig",
    "RMSNorm",
    "build_layers",
    "build_model",
    "choose_n_heads",
    "export_hf_llama",
    "flops_per_token",
    "get_preset",
    "layer_flops",
    "load_hf_llama",
    "load_model",
    "param_count",
    "run_layers",
    "save_model",
]
