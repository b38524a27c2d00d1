"""sysx Llama vs Hugging Face ``transformers.LlamaForCausalLM`` (randomly initialised, nothing downloaded).

Checks: logits and loss (fp32, max abs diff <= 1e-5), parameter gradients (max|g_sysx - g_hf| /
max|g_hf| <= 1e-5 per parameter) for GQA, non-GQA and tied-embedding configs; both import paths
(HF directory, (LlamaConfig, state_dict)); export -> ``from_pretrained`` round trip (single file
and sharded); ``sysx convert`` in both directions and its errors.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from sysx.cli import main as sysx_main  # noqa: E402
from sysx.model import export_hf_llama, load_hf_llama, load_model, save_model  # noqa: E402
from sysx.model.hf import config_from_hf, hf_key_map  # noqa: E402

VOCAB, BATCH, SEQ = 96, 3, 17
CONFIGS = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa_tied": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
}


# Llama-3.1 RoPE scaling with a short original context, so that the 16 frequencies of a 16-wide head fall
# in all three bands (wavelength < 16 kept, > 64 divided by the factor, between interpolated).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 5000.0,
}


def make_hf(
    name: str, attn: str = "eager", seed: int = 0, rope: dict | None = None
) -> tuple[LlamaConfig, LlamaForCausalLM]:
    """A random fp32 HF Llama; norm weights are perturbed too, so a swapped norm would show."""
    rope_args = {"rope_parameters": rope} if rope else {"rope_theta": 5000.0}
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=256 if rope else 64,
        attn_implementation=attn,
        **rope_args,
        **CONFIGS[name],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return config, model


def batch(seed: int = 1, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, HF-style labels (unshifted, some ignored) and the equivalent sysx labels (shifted)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
    hf_labels = ids.clone()
    hf_labels[0, 4:9] = -100
    sysx_labels = F.pad(hf_labels[:, 1:], (0, 1), value=-100)
    return ids, hf_labels, sysx_labels


def max_rel_grad_diff(hf_model: LlamaForCausalLM, model) -> dict[str, float]:
    hf_params = dict(hf_model.named_parameters())
    ours = dict(model.named_parameters())
    out = {}
    for our_name, hf_name in hf_key_map(model.config).items():
        g_hf, g_ours = hf_params[hf_name].grad, ours[our_name].grad
        out[hf_name] = ((g_ours - g_hf).abs().max() / g_hf.abs().max()).item()
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_loss_and_grads_match_hf(name: str) -> None:
    config, hf_model = make_hf(name)
    ids, hf_labels, sysx_labels = batch()
    out = hf_model(input_ids=ids, labels=hf_labels)
    out.loss.backward()

    model = load_hf_llama((config, hf_model.state_dict()))
    assert model.config.tie_embeddings == config.tie_word_embeddings
    if config.tie_word_embeddings:
        assert model.head.lm_head.weight is model.embedding.weight
    with torch.no_grad():
        logits = model(ids)
    loss = model.loss(ids, sysx_labels)
    loss.backward()

    logit_diff = (logits - out.logits).abs().max().item()
    loss_diff = (loss - out.loss).abs().item()
    grad_diffs = max_rel_grad_diff(hf_model, model)
    worst = max(grad_diffs, key=grad_diffs.get)
    print(
        f"\n[{name}] max|logits diff|={logit_diff:.3g} |loss diff|={loss_diff:.3g} "
        f"max rel grad diff={grad_diffs[worst]:.3g} ({worst})"
    )
    assert logit_diff <= 1e-5
    assert loss_diff <= 1e-5
    assert grad_diffs[worst] <= 1e-5, grad_diffs


def test_llama3_rope_tables_match_hf_rotary_embedding() -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from sysx.model.attention import rope_cos_sin

    config, _ = make_hf("gqa", rope=LLAMA3_ROPE)
    cfg = config_from_hf(config.to_dict())
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_len) == ("llama3", 8.0, 64)
    positions = torch.arange(200)[None]
    cos_hf, sin_hf = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_cos_sin(cfg, 200, torch.device("cpu"), torch.float32)
    assert (cos - cos_hf[0]).abs().max().item() <= 1e-5 and (sin - sin_hf[0]).abs().max().item() <= 1e-5
    plain, _ = rope_cos_sin(
        dataclasses.replace(
            cfg,
            rope_type="default",
            rope_factor=None,
            rope_low_freq_factor=None,
            rope_high_freq_factor=None,
            rope_original_max_len=None,
        ),
        200,
        torch.device("cpu"),
        torch.float32,
    )
    assert (plain - cos).abs().max().item() > 0.1  # the scaling changed the long wavelengths


def test_llama3_rope_scaling_matches_hf_logits_loss_and_grads_and_round_trips(tmp_path) -> None:
    config, hf_model = make_hf("gqa", rope=LLAMA3_ROPE)
    ids, hf_labels, sysx_labels = batch(seq=150)  # positions beyond the original 64
    out = hf_model(input_ids=ids, labels=hf_labels)
    out.loss.backward()
    model = load_hf_llama((config, hf_model.state_dict()))
    assert model.config.rope_type == "llama3"
    with torch.no_grad():
        assert (model(ids) - out.logits).abs().max().item() <= 1e-5
    loss = model.loss(ids, sysx_labels)
    loss.backward()
    assert abs(loss.item() - out.loss.item()) <= 1e-5
    assert max(max_rel_grad_diff(hf_model, model).values()) <= 1e-5
    export_hf_llama(model, tmp_path / "out")
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert reloaded.config.rope_parameters["rope_type"] == "llama3"
    assert load_hf_llama(tmp_path / "out").config == model.config
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - out.logits).abs().max().item() <= 1e-5


def test_matches_hf_sdpa_attention_too() -> None:
    config, hf_model = make_hf("gqa", attn="sdpa")
    ids, hf_labels, sysx_labels = batch(seed=2)
    out = hf_model(input_ids=ids, labels=hf_labels)
    model = load_hf_llama((config, hf_model.state_dict()))
    with torch.no_grad():
        assert (model(ids) - out.logits).abs().max().item() <= 1e-5
        assert abs(model.loss(ids, sysx_labels).item() - out.loss.item()) <= 1e-5


@pytest.mark.parametrize("name", ["gqa", "gqa_tied"])
def test_load_from_hf_directory(tmp_path, name: str) -> None:
    _, hf_model = make_hf(name)
    hf_model.save_pretrained(tmp_path / "hf")
    ids, _, _ = batch()
    model = load_hf_llama(tmp_path / "hf")
    with torch.no_grad():
        assert (model(ids) - hf_model(input_ids=ids).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", ["mha", "gqa_tied"])
def test_export_then_from_pretrained_gives_same_logits(tmp_path, name: str) -> None:
    config, hf_model = make_hf(name)
    model = load_hf_llama((config, hf_model.state_dict()))
    export_hf_llama(model, tmp_path / "out")
    cfg_json = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg_json["tie_word_embeddings"] == config.tie_word_embeddings
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert reloaded.config.rope_parameters["rope_theta"] == 5000.0
    ids, _, _ = batch()
    with torch.no_grad():
        diff = (reloaded(input_ids=ids).logits - model(ids)).abs().max().item()
    assert diff <= 1e-5


def test_sharded_export_loads_in_hf_and_sysx(tmp_path) -> None:
    config, hf_model = make_hf("gqa")
    model = load_hf_llama((config, hf_model.state_dict()))
    export_hf_llama(model, tmp_path / "out", max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids, _, _ = batch()
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    again = load_hf_llama(tmp_path / "out")
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - model(ids)).abs().max().item() <= 1e-5
        assert torch.equal(again(ids), model(ids))


def test_transformers_4_config_layout_is_read() -> None:
    legacy = {
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 7000.0,
        "rope_scaling": None,
        "max_position_embeddings": 64,
    }
    cfg = config_from_hf(legacy)
    assert (cfg.rope_theta, cfg.n_kv_heads, cfg.norm_eps, cfg.tie_embeddings) == (7000.0, 2, 1e-6, False)
    scaled = config_from_hf(
        {
            **legacy,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        }
    )
    assert (scaled.rope_type, scaled.rope_factor, scaled.rope_original_max_len, scaled.rope_theta) == (
        "llama3",
        8.0,
        32,
        7000.0,
    )
    with pytest.raises(ValueError, match="rope_scaling of rope_type 'llama3' lacks"):
        config_from_hf({**legacy, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="rope_scaling.rope_type='yarn'"):
        config_from_hf({**legacy, "rope_scaling": {"rope_type": "yarn", "factor": 8.0}})
    with pytest.raises(ValueError, match="lacks"):
        config_from_hf({"model_type": "llama"})


def test_unsupported_hf_config_is_a_clear_error() -> None:
    config, hf_model = make_hf("gqa")
    hf = config.to_dict()
    hf["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    with pytest.raises(ValueError, match="rope_type"):
        load_hf_llama((hf, hf_model.state_dict()))
    broken = dict(hf_model.state_dict())
    del broken["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing.*up_proj"):
        load_hf_llama((config, broken))


def test_convert_command_round_trip(tmp_path, capsys) -> None:
    _, hf_model = make_hf("gqa_tied")
    hf_model.save_pretrained(tmp_path / "hf")
    sysx_file = tmp_path / "m.safetensors"
    assert sysx_main(["convert", "--from-hf", str(tmp_path / "hf"), str(sysx_file)]) == 0
    model = load_model(sysx_file)
    assert model.config.tie_embeddings
    assert sysx_main(["convert", "--to-hf", str(sysx_file), str(tmp_path / "back")]) == 0
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    ids, _, _ = batch()
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - hf_model(input_ids=ids).logits).abs().max().item() <= 1e-5
    assert "wrote" in capsys.readouterr().out

    # bf16 on the way out
    assert sysx_main(["convert", "--to-hf", "--dtype", "bfloat16", str(sysx_file), str(tmp_path / "bf16")]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_hf_llama(tmp_path / "bf16").embedding.weight.dtype == torch.bfloat16


def test_convert_command_errors(tmp_path, capsys) -> None:
    assert sysx_main(["convert", "--to-hf", str(tmp_path / "nope.safetensors"), str(tmp_path / "o")]) == 1
    assert "does not exist" in capsys.readouterr().err
    _, hf_model = make_hf("gqa")
    hf_model.save_pretrained(tmp_path / "hf")
    # An HF weights file is safetensors but not a sysx model file.
    assert sysx_main(["convert", "--to-hf", str(tmp_path / "hf" / "model.safetensors"), str(tmp_path / "o")]) == 1
    assert "not a sysx model file" in capsys.readouterr().err
    # A sysx file is not an HF directory.
    save_model(load_hf_llama(tmp_path / "hf"), tmp_path / "m.safetensors")
    assert sysx_main(["convert", "--from-hf", str(tmp_path / "m.safetensors"), str(tmp_path / "x")]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert sysx_main(["convert", str(tmp_path / "a"), str(tmp_path / "b")]) == 2  # no direction
    assert "--to-hf" in capsys.readouterr().err
