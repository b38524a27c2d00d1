"""Pretrained weights layer by layer (``model.init_from``) and exports others can load."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from sysx.checkpoint import CheckpointSaver, LayerState
from sysx.checkpoint.pretrained import build_model, open_pretrained
from sysx.cli import main as sysx_main
from sysx.data.prepare import prepare
from sysx.data.tokenizer import kept_tokenizer_dir
from sysx.model import load_hf_llama, save_model
from test_data import _word_tokenizer
from test_hf_parity import make_hf


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
    saver.save(2, {i: (lambda i=i: LayerState(i, by_layer[i], zeros[i], zeros[i], 2)) for i in by_layer},
               manifest={"model": {**vars(model.config)}})
    saver.close()
    from_ckpt = build_model(open_pretrained(tmp_path / "ckpt"))
    assert all(torch.equal(p, params[n]) for n, p in from_ckpt.named_parameters())
    assert sysx_main(["convert", "--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert torch.equal(dict(load_hf_llama(tmp_path / "out").named_parameters())["layers.1.attn.q_proj.weight"],
                       params["layers.1.attn.q_proj.weight"])


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
        assert sysx_main(["convert", "--to-hf", str(tmp_path / "m.safetensors"), str(tmp_path / "hf"),
                          "--tokenizer", str(kept)]) == 0
    finally:
        os.umask(old)
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for p in (tmp_path / "hf").iterdir():
        assert os.stat(p).st_mode & stat.S_IRGRP, p.name
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded.convert_tokens_to_ids("w2") == 4
