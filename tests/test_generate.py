"""``sysx generate``: the KV cache computes what the full forward computes, greedy output equals
``transformers``' ``generate`` (raw and chat prompts, resident and streamed layers, from a Hugging Face
folder and from a run directory), seeded sampling repeats, and the reply streams whole characters."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_hf_parity import make_hf

from sysx.checkpoint.pretrained import open_pretrained
from sysx.config import load_config
from sysx.data.prepare import prepare
from sysx.data.tokenizer import ByteTokenizer, kept_tokenizer_dir
from sysx.generate.cli import parse_args, run
from sysx.generate.decoder import Decoder, plan
from sysx.generate.sampling import Sampler
from sysx.generate.source import BYTE, run_tokenizer
from sysx.generate.text import TextStream
from sysx.model import load_hf_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 24
STREAMED_GB = "0.0017"  # the tiny model's KV cache and two of its 721 KiB block slots, not all five layers


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/tiny_hf_model.py's folder: a tiny Llama, a BPE tokenizer and a ChatML template."""
    root = tmp_path_factory.mktemp("generate")
    run_example = [sys.executable, "-X", "utf8"]
    subprocess.run(
        [*run_example, ROOT / "examples" / "stdlib_instructions.py", "--output", root / "chat.jsonl"], check=True
    )
    subprocess.run(
        [
            *run_example,
            ROOT / "examples" / "tiny_hf_model.py",
            "--text",
            root / "chat.jsonl",
            "--output",
            root / "tiny",
        ],
        check=True,
        capture_output=True,
    )
    return root / "tiny"


def _generate(argv: list[str]) -> tuple[list[int], str, str]:
    """New ids, stdout and stderr of ``sysx generate argv`` on the CPU in fp32 (as transformers runs here)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        ids = run(parse_args([*argv, "--device", "cpu", "--dtype", "fp32"]))
    return ids, out.getvalue(), err.getvalue()


def _transformers_greedy(folder: Path, prompt_ids: list[int]) -> list[int]:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_kv_cache_passes_give_the_full_forward_logits(tmp_path: Path, streamed: bool) -> None:
    """Prefill 5 tokens, then one token per pass: each pass's logits are the full-sequence forward's at
    that position (sysx and transformers), with tied embeddings and grouped-query attention."""
    _, hf = make_hf("gqa_tied")
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, hf.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    weights = open_pretrained(tmp_path / "hf")
    with torch.no_grad():
        full = load_hf_llama(tmp_path / "hf")(torch.tensor([ids]))[0]
        theirs = hf(torch.tensor([ids])).logits[0]
    host, placement = plan(
        weights, dtype=torch.float32, prompt_len=5, positions=12, budget=200_000 if streamed else None
    )
    assert placement.resident is not streamed and placement.window == (1 if streamed else 3)
    decoder = Decoder(weights, host, placement, device=torch.device("cpu"), positions=12)
    passes = [decoder.forward(ids[:5], 0)] + [decoder.forward([ids[t]], t) for t in range(5, 12)]
    for t, logits in zip(range(4, 12), passes):
        torch.testing.assert_close(logits, full[t], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits, theirs[t], rtol=0, atol=1e-5)


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
@pytest.mark.parametrize("kind", ["prompt", "chat"])
def test_greedy_equals_transformers_generate(tiny_chat_model: Path, kind: str, streamed: bool) -> None:
    budget = ["--device-memory-gb", STREAMED_GB] if streamed else []
    text = "def parse(text):" if kind == "prompt" else "What does json.dumps do?"
    ids, shown, status = _generate(
        ["--model", str(tiny_chat_model), f"--{kind}", text, "--max-new-tokens", str(NEW_TOKENS), *budget]
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_chat_model)
    if kind == "chat":
        messages = [{"role": "user", "content": text}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    else:
        prompt = tokenizer(text)["input_ids"]
    assert ids == _transformers_greedy(tiny_chat_model, prompt)
    assert shown == tokenizer.decode(ids, skip_special_tokens=True) + "\n"
    assert ("streamed with window W=2 of 5 layers" in status) is streamed
    assert ("resident" in status) is not streamed


def test_seeded_sampling_repeats_and_a_tiny_top_p_is_greedy(tiny_chat_model: Path) -> None:
    args = ["--model", str(tiny_chat_model), "--prompt", "import os", "--max-new-tokens", "16"]
    sampled = [_generate([*args, "--temperature", "1.5", "--seed", seed])[0] for seed in ("3", "3", "4")]
    assert sampled[0] == sampled[1] != sampled[2]
    greedy = _generate(args)[0]
    assert _generate([*args, "--temperature", "1.5", "--top-p", "1e-6", "--seed", "5"])[0] == greedy


def test_top_p_samples_only_the_nucleus() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    for top_p, allowed in ((0.5, {0}), (0.75, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})):
        sampler = Sampler(temperature=1.0, top_p=top_p, seed=0)
        drawn = {sampler(logits) for _ in range(300)}
        assert drawn == allowed, top_p


def test_the_stream_prints_whole_characters() -> None:
    byte = ByteTokenizer()
    out = io.StringIO()
    stream = TextStream(byte.decode, out)
    for token in byte.encode("naïve €"):
        stream.push(token)
        assert "\ufffd" not in out.getvalue()
    assert stream.end() == "naïve €" and out.getvalue() == "naïve €\n"


def test_a_run_directory_and_its_checkpoints_sample_like_their_export(tiny_chat_model: Path, tmp_path: Path) -> None:
    """Train 2 steps from the tiny folder; generate from the run directory (tokenizer found through
    model.init_from) equals transformers.generate on the run's Hugging Face export."""
    from sysx.train import main as train

    (tmp_path / "text.txt").write_text("def parse(text):\n    return text.split()\n" * 50)
    prepare([tmp_path / "text.txt"], tmp_path / "tok.bin", tokenizer=tiny_chat_model, val_fraction=0.0, progress=False)
    args = [f"model.init_from={tiny_chat_model}", "data=file", f"data.path={tmp_path / 'tok.bin'}", "train.seq_len=32"]
    args += ["train.steps=2", "eval.every=0", "device=cpu", "log.progress=false", "schedule=reference"]
    assert (
        train(
            [*args, f"run_dir={tmp_path / 'run'}", "checkpoint.export_hf=true", "optim.lr=0.01", "optim.warmup_steps=0"]
        )
        == 0
    )
    prompt = ["--prompt", "def parse(text):", "--max-new-tokens", str(NEW_TOKENS)]
    from_run, _, status = _generate(["--model", str(tmp_path / "run"), *prompt])
    assert "step-00000002 (step 2)" in status
    assert _generate(["--model", str(tmp_path / "run" / "checkpoints"), *prompt])[0] == from_run
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_chat_model)
    assert from_run == _transformers_greedy(tmp_path / "run" / "hf", tokenizer("def parse(text):")["input_ids"])
    assert from_run != _generate(["--model", str(tiny_chat_model), *prompt])[0]  # the 2 steps changed the model


def test_the_tokenizer_of_a_run_is_found_in_its_configuration(tiny_chat_model: Path, tmp_path: Path) -> None:
    assert run_tokenizer(load_config([])) == BYTE  # the quick start's byte-level corpus
    (tmp_path / "t.txt").write_text("some text to tokenize " * 20)
    prepare([tmp_path / "t.txt"], tmp_path / "t.bin", tokenizer=tiny_chat_model, val_fraction=0.0, progress=False)
    from_data = run_tokenizer(load_config(["data=file", f"data.path={tmp_path / 't.bin'}"]))
    assert from_data == str(kept_tokenizer_dir(tmp_path / "t.bin"))
    prepare([tmp_path / "t.txt"], tmp_path / "b.bin", tokenizer="byte", val_fraction=0.0, progress=False)
    assert run_tokenizer(load_config(["data=file", f"data.path={tmp_path / 'b.bin'}"])) == BYTE
    init = load_config([f"model.init_from={tiny_chat_model}", "data=file", f"data.path={tmp_path / 'b.bin'}"])
    assert run_tokenizer(init) == str(tiny_chat_model)


# (argv after `sysx generate`, substrings of the one line: the value and the fix). {tiny}: the tiny chat
# folder; {d}: this test's folder, holding `junk/` (no model), `junk.safetensors` (not one),
# `plain/` (an HF folder without a tokenizer), `m.safetensors` (a sysx model file, vocab 96).
BAD_INPUTS: list[tuple[str, list[str]]] = [
    ("--model {d}/nope --prompt x", ["--model", "nope", "no such file", "Hugging Face"]),
    ("--model {d}/junk --prompt x", ["--model", "junk", "no config.json", "give a Hugging Face folder"]),
    ("--model {d}/junk.safetensors --prompt x", ["--model", "junk.safetensors", "not a model", "give a"]),
    ("--model {d}/m.safetensors --prompt x", ["no tokenizer found", "--tokenizer"]),
    ("--model {d}/plain --prompt x", ["no tokenizer found", "--tokenizer"]),
    ("--model {tiny} --tokenizer {d}/nope --prompt x", ["--tokenizer", "nope", "no such file", "byte"]),
    ("--model {tiny} --tokenizer byte --chat hi", ["--chat needs a chat template", "byte", "--prompt"]),
    ("--model {d}/m.safetensors --tokenizer byte --prompt zzz", ["ids reach 122", "vocabulary has 96", "--tokenizer"]),
    ("--model {tiny} --prompt x --temperature -1", ["--temperature -1.0", ">= 0"]),
    ("--model {tiny} --prompt x --top-p 0", ["--top-p 0.0", "(0, 1]"]),
    ("--model {tiny} --prompt x --top-p 1.5", ["--top-p 1.5", "(0, 1]"]),
    ("--model {tiny} --prompt x --max-new-tokens 0", ["--max-new-tokens 0", ">= 1"]),
    ("--model {tiny} --prompt x --system be-brief", ["--system needs --chat"]),
    (
        "--model {tiny} --prompt x --max-new-tokens 600",
        ["plus --max-new-tokens 600", "max_seq_len 512", "lower --max-new-tokens to 511"],
    ),
    (
        "--model {tiny} --tokenizer byte --prompt " + "x" * 600,
        ["prompt's 600 tokens", "max_seq_len 512", "shorten the prompt"],
    ),
    (
        "--model {tiny} --prompt x --device-memory-gb 0.0001",
        ["--device-memory-gb 0.0001", "KV cache", "give --device-memory-gb 0.000"],
    ),
    ("--model {tiny} --prompt x --device nonsense", ["--device nonsense", "give auto, cpu, cuda or cuda:N"]),
    ("--model {tiny} --prompt x --device-memory-gb -2", ["--device-memory-gb -2.0", "> 0"]),
]


@pytest.fixture(scope="module")
def bad_inputs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sysx.model import save_model

    root = tmp_path_factory.mktemp("generate_bad")
    (root / "junk").mkdir()
    (root / "junk" / "notes.txt").write_text("not a model")
    (root / "junk.safetensors").write_bytes(b"not a safetensors file")
    _, hf = make_hf("gqa")
    hf.save_pretrained(root / "plain")
    save_model(load_hf_llama(root / "plain"), root / "m.safetensors")
    return root


@pytest.mark.parametrize(("argv", "expected"), BAD_INPUTS, ids=[case for case, _ in BAD_INPUTS])
def test_a_bad_input_is_one_line(tiny_chat_model: Path, bad_inputs_dir: Path, argv: str, expected: list[str]) -> None:
    from sysx.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["generate", *argv.format(tiny=tiny_chat_model, d=bad_inputs_dir).split()])
    lines = err.getvalue().splitlines()
    assert code == 2 and len(lines) == 1 and not out.getvalue(), err.getvalue()
    assert lines[0].startswith("sysx generate: ")
    for part in expected:
        assert part in lines[0], (part, lines[0])
