"""Pretrained weights layer by layer (``model.init_from``) and exports others can load."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from test_data import _word_tokenizer
from test_hf_parity import make_hf

from sysx.checkpoint import CheckpointSaver, LayerState
from sysx.checkpoint.pretrained import build_model, open_pretrained
from sysx.cli import main as sysx_main
from sysx.data.prepare import prepare
from sysx.data.tokenizer import kept_tokenizer_dir
from sysx.model import load_hf_llama, save_model


def test_sharded_hf_folder_is_read_one_layer_at_a_time(tmp_path: Path) -> None:
    _, hf = make_hf("gqa")
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # several shards + index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    weights = open_pretrained(tmp_path / "hf")
    reference = dict(load_hf_llama(tmp_path / "hf").named_parameters())
    cfg = weights.config
    seen = {}
    for index in range(cfg.n_layers + 2):
        layer = weights.layer(index)
        assert layer and all(name.startswith(f"layers.{index}.") for name in layer)
        seen.update(layer)
    assert seen.keys() == reference.keys()
    assert all(torch.equal(seen[n], reference[n]) for n in seen)


def test_a_sysx_model_file_and_a_checkpoint_are_sources_too(tmp_path: Path) -> None:
    _, hf = make_hf("gqa_tied")
    model = load_hf_llama((hf.config, hf.state_dict()))
    save_model(model, tmp_path / "m.safetensors")
    from_file = build_model(open_pretrained(tmp_path / "m.safetensors"))
    params = dict(model.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in from_file.named_parameters())
    saver = CheckpointSaver(tmp_path / "ckpt", rank=0, world=1, keep=1, tag="t")
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, p in params.items():
        by_layer.setdefault(int(name.split(".")[1]), {})[name] = p.detach()
    zeros = {i: {n: torch.zeros_like(t) for n, t in ts.items()} for i, ts in by_layer.items()}
    saver.save(
        2,
        {i: (lambda i=i: LayerState(i, by_layer[i], zeros[i], zeros[i], 2)) for i in by_layer},
        manifest={"model": {**vars(model.config)}},
    )
    saver.close()
    from_ckpt = build_model(open_pretrained(tmp_path / "ckpt"))
    assert all(torch.equal(p, params[n]) for n, p in from_ckpt.named_parameters())
    assert sysx_main(["convert", "--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert torch.equal(
        dict(load_hf_llama(tmp_path / "out").named_parameters())["layers.1.attn.q_proj.weight"],
        params["layers.1.attn.q_proj.weight"],
    )


def test_export_is_group_readable_and_carries_the_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    tok = _word_tokenizer(tmp_path / "tok" / "tokenizer.json", 50)
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (tmp_path / "a.txt").write_text("w1 w2 w3\n")
    prepare([tmp_path / "a.txt"], tmp_path / "data" / "t.bin", tokenizer=tok, val_fraction=0.0, progress=False)
    kept = kept_tokenizer_dir(tmp_path / "data" / "t.bin")
    assert sorted(p.name for p in kept.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    _, hf = make_hf("gqa")
    save_model(load_hf_llama((hf.config, hf.state_dict())), tmp_path / "m.safetensors")
    old = os.umask(0o077)  # the setting that made exports private before
    try:
        assert (
            sysx_main(
                ["convert", "--to-hf", str(tmp_path / "m.safetensors"), str(tmp_path / "hf"), "--tokenizer", str(kept)]
            )
            == 0
        )
    finally:
        os.umask(old)
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for p in (tmp_path / "hf").iterdir():
        assert os.stat(p).st_mode & stat.S_IRGRP, p.name
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded.convert_tokens_to_ids("w2") == 4


@pytest.mark.parametrize("trainer", ["reference", "single"])
def test_training_from_a_sharded_hf_llama_starts_at_transformers_loss(tmp_path: Path, trainer: str) -> None:
    """model.init_from: the shape comes from config.json (no preset), the weights stream layer by
    layer from the shards, and the first step's loss is what transformers computes for that batch."""
    transformers = pytest.importorskip("transformers")
    import torch.nn.functional as F

    from sysx.config import EvalSection, ModelSection, SingleSection, SysxConfig, TrainSection
    from sysx.data import TokenDataset, default_corpus_path, get_batch
    from sysx.single.hardware import assumed_hardware
    from sysx.trainers.reference import ReferenceTrainer
    from sysx.trainers.single import SingleTrainer

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).float()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    cfg = SysxConfig(
        model=ModelSection(init_from=str(tmp_path / "hf")),
        train=TrainSection(steps=1, micro_batch_size=2, micro_batches=2, seq_len=32),
        eval=EvalSection(every=0),
        device="cpu",
    )
    if trainer == "reference":
        t = ReferenceTrainer(cfg)
    else:
        t = SingleTrainer(
            cfg,
            single=SingleSection(window=1, micro_batch_size=2, print_plan=False),
            hardware=assumed_hardware("rtx4090", device_memory_gib=1, host_memory_gib=8),
        )
    with t:
        assert t.model_cfg.n_layers == 3 and t.model_cfg.n_kv_heads == 2 and not t.model_cfg.tie_embeddings
        first = t.run(1)[0].loss
    dataset = TokenDataset(default_corpus_path())
    losses = []
    with torch.no_grad():
        for j in range(2):
            x, y = get_batch(dataset, seed=0, step=0, micro_batch=j, micro_batch_size=2, seq_len=32, split="train")
            logits = hf(input_ids=x).logits
            losses.append(float(F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))))
    expected = sum(losses) / len(losses)
    assert abs(first - expected) <= 1e-5 * expected, (first, expected)


def test_init_from_takes_the_shape_and_refuses_a_conflicting_field(tmp_path: Path) -> None:
    """The job reads the weights' shape (config itself opens no files); a conflicting field, a
    missing folder or a sequence over the weights' max_seq_len is one line."""
    from sysx.checkpoint.pretrained import job_model_config
    from sysx.config import ConfigError, load_config

    _, hf = make_hf("gqa")
    hf.save_pretrained(tmp_path / "hf")
    cfg = load_config([f"model.init_from={tmp_path / 'hf'}", "train.seq_len=32"])
    assert job_model_config(cfg).n_kv_heads == hf.config.num_key_value_heads
    with pytest.raises(ConfigError) as err:
        job_model_config(load_config([f"model.init_from={tmp_path / 'hf'}", "model.dim=128"]))
    assert "model.dim=128" in str(err.value) and "dim=64" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="model.init_from=.*nope.*does not exist"):
        job_model_config(load_config([f"model.init_from={tmp_path / 'nope'}"]))
    too_long = hf.config.max_position_embeddings * 2
    with pytest.raises(ConfigError, match=f"train.seq_len={too_long}.*max_seq_len"):
        job_model_config(load_config([f"model.init_from={tmp_path / 'hf'}", f"train.seq_len={too_long}"]))


def test_the_fine_tuning_path_of_the_readme(tmp_path: Path) -> None:
    """Prepare text with the model's tokenizer, train from the HF folder, stop, resume, export with
    checkpoint.export_hf=true, load the export with transformers and generate."""
    transformers = pytest.importorskip("transformers")
    from sysx.train import main

    (tmp_path / "base").mkdir()
    _word_tokenizer(tmp_path / "base" / "tokenizer.json", 60)  # vocab 62
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=3,
        eos_token_id=0,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    (tmp_path / "text.txt").write_text(" ".join(f"w{i % 60}" for i in range(3000)))
    prepare(
        [tmp_path / "text.txt"],
        tmp_path / "data" / "tok.bin",
        tokenizer=tmp_path / "base",
        val_fraction=0.1,
        progress=False,
    )
    args = [
        f"model.init_from={tmp_path / 'base'}",
        "data=file",
        f"data.path={tmp_path / 'data' / 'tok.bin'}",
        "train.seq_len=16",
        "train.micro_batch_size=2",
        "eval.every=0",
        "device=cpu",
        "log.progress=false",
        f"run_dir={tmp_path / 'run'}",
        "checkpoint.export_hf=true",
        "schedule=reference",
    ]
    assert main([*args, "train.steps=2"]) == 0  # "stopped" after 2 steps
    assert main([*args, "train.steps=4"]) == 0  # the same command again resumes and finishes
    export = tmp_path / "run" / "hf"
    assert (export / "tokenizer.json").is_file() and (export / "config.json").is_file()
    exported = json.loads((export / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (3, 0)  # the source model's
    converted = tmp_path / "converted"
    assert sysx_main(["convert", "--to-hf", str(tmp_path / "run" / "checkpoints"), str(converted)]) == 0
    assert json.loads((converted / "config.json").read_text())["bos_token_id"] == 3  # via the run's init_from
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    ids = tokenizer("w1 w2 w3", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)


def test_an_export_without_a_source_model_takes_the_special_tokens_from_the_tokenizer(tmp_path: Path) -> None:
    _, hf = make_hf("gqa")
    save_model(load_hf_llama((hf.config, hf.state_dict())), tmp_path / "m.safetensors")
    (tmp_path / "tok").mkdir()
    _word_tokenizer(tmp_path / "tok" / "tokenizer.json", 20)  # <|endoftext|> is id 0
    out = tmp_path / "out"
    assert (
        sysx_main(
            ["convert", "--to-hf", str(tmp_path / "m.safetensors"), str(out), "--tokenizer", str(tmp_path / "tok")]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == 0 and "bos_token_id" not in config
    (tmp_path / "tok" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "w1", "eos_token": {"content": "w2"}})
    )
    assert (
        sysx_main(
            ["convert", "--to-hf", str(tmp_path / "m.safetensors"), str(out), "--tokenizer", str(tmp_path / "tok")]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (3, 4)
