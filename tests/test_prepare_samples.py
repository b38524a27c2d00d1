"""``sysx data prepare`` on instruction data: chat JSONL / Parquet / save_to_disk folders and
prompt/completion rows become sample files whose masks sit exactly on the trained tokens (checked
against transformers' own rendering and offsets), shuffled deterministically; bad rows are reported
one line per kind, and every bad input is one line."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sysx.data import IGNORE_INDEX, DataError, TokenDataset, check_samples_fit, get_batch
from sysx.data.prepare import main as data_main

ROOT = Path(__file__).resolve().parents[1]
N_CHATS = 40


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with ``chat.jsonl`` (N_CHATS real chats + two multi-turn ones with a system turn) and
    ``tok/``: the tiny example model's tokenizer (ChatML template, eos <|im_end|>, pad <|endoftext|>)."""
    root = tmp_path_factory.mktemp("sft")
    full = root / "all.jsonl"
    assert _example("stdlib_instructions").main(["--output", str(full)]) == 0
    chats = [json.loads(line) for line in full.read_text().splitlines()[:N_CHATS]]
    chats += [
        {
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is `os.sep`?"},
                {"role": "assistant", "content": "The path separator."},
                {"role": "user", "content": "And `os.linesep`?"},
                {"role": "assistant", "content": "The line separator."},
            ]
        }
    ] * 2
    (root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    tok_dir = root / "tok"
    tok_dir.mkdir()
    _example("tiny_hf_model").train_tokenizer((m["content"] for c in chats for m in c["messages"]), 512, tok_dir)
    return root


def _run(*argv: str) -> tuple[int, str, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = data_main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _prepare(inputs: Path, output: Path, tok: Path, *extra: str) -> TokenDataset:
    rc, out, err = _run(
        "prepare", "--input", str(inputs), "--output", str(output), "--tokenizer", str(tok), "--quiet", *extra
    )
    assert rc == 0, err
    assert out.splitlines()[-1].startswith(f"wrote {output}: ")
    return TokenDataset(output)


def _file_samples(ds: TokenDataset) -> list[tuple[list[int], list[int]]]:
    assert ds.samples is not None
    off = ds.samples.offsets
    return [
        (ds.tokens[off[i] : off[i + 1]].tolist(), ds.samples.mask[off[i] : off[i + 1]].tolist())
        for i in range(ds.samples.num_samples)
    ]


def _expected_chat(tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Independently: transformers renders and tokenizes the chat; a token is trained when its characters
    lie in an assistant answer or the <|im_end|> closing it (found in the text, mapped by offsets)."""
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, pos = [], 0
    for m in messages:
        head = f"<|im_start|>{m['role']}\n"
        pos = text.index(head + m["content"] + "<|im_end|>", pos) + len(head)
        end = pos + len(m["content"]) + len("<|im_end|>")
        if m["role"] == "assistant":
            spans.append((pos, end))
        pos = end
    mask = [int(any(a <= s and e <= b for a, b in spans)) for s, e in enc["offset_mapping"]]
    return enc["input_ids"], mask


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow"])
def test_chat_masks_are_the_assistant_tokens(sft_inputs: Path, tmp_path: Path, kind: str) -> None:
    from transformers import AutoTokenizer

    source = sft_inputs / "chat.jsonl"
    if kind != "jsonl":
        import datasets
        import pyarrow as pa

        rows = datasets.load_dataset("json", data_files=str(sft_inputs / "chat.jsonl"), split="train")
        source = tmp_path / f"chat.{kind}"
        if kind == "parquet":
            rows.to_parquet(source)
        else:
            with pa.ipc.new_stream(str(source), rows.data.table.schema) as stream:
                stream.write_table(rows.data.table)
    ds = _prepare(source, tmp_path / "sft.bin", sft_inputs / "tok", "--val-fraction", "0.1")
    tok = AutoTokenizer.from_pretrained(str(sft_inputs / "tok"))
    chats = [json.loads(line)["messages"] for line in (sft_inputs / "chat.jsonl").read_text().splitlines()]
    expected = sorted(_expected_chat(tok, m) for m in chats)
    assert sorted(_file_samples(ds)) == expected  # every row exactly once, masks on the answers only
    assert ds.meta["sample_format"] == "chat" and ds.meta["sample_splits"] == {"train": [0, 38], "val": [38, 42]}
    assert ds.samples is not None and ds.samples.pad_id == tok.pad_token_id
    # a batch of the real file: each row one sample from position 0; padding and prompts are -100
    x, y = get_batch(ds, seed=0, step=1, micro_batch=0, micro_batch_size=4, seq_len=1024, rows_per_step=4)
    samples = {tuple(ids): mask for ids, mask in _file_samples(ds)}
    for row in range(4):
        n = next(len(ids) for ids in samples if list(ids) == x[row, : len(ids)].tolist())
        ids, mask = x[row, :n].tolist(), samples[tuple(x[row, :n].tolist())]
        want = [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(n - 1)]
        assert y[row, : n - 1].tolist() == want and (y[row, n - 1 :] == IGNORE_INDEX).all()
        assert (x[row, n:] == tok.pad_token_id).all()


def test_info_marks_the_trained_tokens(sft_inputs: Path, tmp_path: Path) -> None:
    _prepare(sft_inputs / "chat.jsonl", tmp_path / "sft.bin", sft_inputs / "tok")
    rc, out, _ = _run("info", str(tmp_path / "sft.bin"))
    assert rc == 0
    assert f"samples:    {N_CHATS + 2} (train {N_CHATS + 1}, val 1); format chat" in out
    assert "trained:    " in out and "length:     max " in out and "packing:    seq_len " in out
    body = out.split("trained tokens between [[ ]]):\n", 1)[1]
    assert body.startswith("<|im_start|>user\n") and "<|im_start|>assistant\n[[" in body
    assert body.rstrip("\n").endswith("<|im_end|>]]")


def test_saved_dataset_and_prompt_completion(sft_inputs: Path, tmp_path: Path) -> None:
    import datasets
    from transformers import AutoTokenizer

    rows = [{"question": f"What is {i} + {i}?", "answer": f"It is {2 * i}."} for i in range(12)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    ds = _prepare(
        tmp_path / "saved",
        tmp_path / "pc.bin",
        sft_inputs / "tok",
        "--prompt-field",
        "question",
        "--completion-field",
        "answer",
    )
    tok = AutoTokenizer.from_pretrained(str(sft_inputs / "tok"))
    expected = []
    for row in rows:
        prompt, answer = tok.encode(row["question"]), tok.encode(row["answer"]) + [tok.eos_token_id]
        expected.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    assert ds.meta["sample_format"] == "prompt-completion" and sorted(_file_samples(ds)) == sorted(expected)
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"body": r["question"]}) + "\n" for r in rows))
    plain = _prepare(text, tmp_path / "text.bin", sft_inputs / "tok", "--format", "text", "--text-field", "body")
    assert all(mask == [0] + [1] * (len(ids) - 1) for ids, mask in _file_samples(plain))


def test_shuffle_is_deterministic_and_val_is_not_the_tail(sft_inputs: Path, tmp_path: Path) -> None:
    args = ("--val-fraction", "0.25", "--seed", "3")
    a = _prepare(sft_inputs / "chat.jsonl", tmp_path / "a.bin", sft_inputs / "tok", *args)
    _prepare(sft_inputs / "chat.jsonl", tmp_path / "b.bin", sft_inputs / "tok", *args)
    c = _prepare(sft_inputs / "chat.jsonl", tmp_path / "c.bin", sft_inputs / "tok", "--val-fraction", "0.25")
    for suffix in (".bin", ".mask.bin", ".idx.bin"):
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()
    assert _file_samples(a) != _file_samples(c) and sorted(_file_samples(a)) == sorted(_file_samples(c))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(sft_inputs / "tok"))
    last_rows = [json.loads(line)["messages"] for line in (sft_inputs / "chat.jsonl").read_text().splitlines()[-10:]]
    # the val split is the last quarter of the shuffled samples, not the last rows of the input
    val = _file_samples(a)[a.meta["sample_splits"]["val"][0] :]
    assert len(val) == 10 and sorted(val) != sorted(_expected_chat(tok, m) for m in last_rows)
    x, _ = get_batch(a, seed=1, step=0, micro_batch=0, micro_batch_size=2, seq_len=1024, rows_per_step=2, split="val")
    assert x.shape == (2, 1024)


BAD_ROWS = [
    {"prompt": "p0", "completion": "fine answer"},
    {"prompt": "p1"},
    {"prompt": "p2", "completion": "  "},
    {"prompt": "p3", "completion": "word " * 80},
    {"prompt": "p4", "completion": "also fine"},
    {"prompt": "p5"},
]


def test_bad_rows_are_counted_one_line_per_kind(sft_inputs: Path, tmp_path: Path) -> None:
    lines = [json.dumps(r).encode() for r in BAD_ROWS] + [b'{"prompt": "p6", "completion": "bad \xff byte"}']
    (tmp_path / "rows.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    argv = ["prepare", "--input", str(tmp_path / "rows.jsonl"), "--output", str(tmp_path / "o.bin"), "--quiet"]
    rc, out, err = _run(*argv, "--tokenizer", str(sft_inputs / "tok"), "--max-tokens", "40")
    assert rc == 0, err
    assert err.splitlines() == [
        "sysx data: 2 rows skipped: missing field 'completion' (first: row 2)",
        "sysx data: 1 row skipped: bad UTF-8 (first: row 7)",
        "sysx data: 1 row skipped: empty answer (first: row 3)",
        "sysx data: 1 row skipped: over-long (> --max-tokens 40) (first: row 4)",
    ]
    assert "2 samples (train 1, val 1)" in out.splitlines()[-1] and "from 7 rows, 5 bad" in out
    assert TokenDataset(tmp_path / "o.bin").meta["bad_rows"]["missing field 'completion'"] == {
        "count": 2,
        "first_row": 2,
    }


def _one_line(err: str, expect: list[str]) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("sysx data: error: ") and "Traceback" not in err, lines[0]
    for part in expect:
        assert part in lines[0], f"{part!r} not in: {lines[0]}"


# (rows of the input file, or None for none; extra arguments; substrings of the one line)
BAD_INPUTS: list[tuple[str, list[Any] | None, list[str], list[str]]] = [
    (
        "missing field",
        [{"prompt": "a", "completion": None}, {"prompt": "b"}],
        [],
        ["all 2 input rows are bad", "2 rows: missing field 'completion' (first: row 1)"],
    ),
    ("empty answer", [{"prompt": "a", "completion": ""}], [], ["all 1 input rows", "empty answer (first: row 1)"]),
    ("over-long", [{"prompt": "a", "completion": "b " * 50}], ["--max-tokens", "8"], ["over-long (> --max-tokens 8)"]),
    ("bad UTF-8", [b'{"prompt": "a", "completion": "\xc3\x28"}'], [], ["all 1 input rows", "bad UTF-8 (first: row 1)"]),
    ("unknown format", [{"text": "a"}], ["--format", "alpaca"], ["--format 'alpaca' is unknown", "auto, text"]),
    (
        "no such column",
        [{"text": "a"}],
        ["--format", "chat"],
        ["needs a column 'messages'", "(text)", "--messages-field"],
    ),
    (
        "no columns known",
        [{"body": "a"}],
        [],
        ["no messages, prompt/completion or text column", "(body)", "--text-field"],
    ),
    ("missing file", None, [], ["input not found", "nope.jsonl"]),
    ("broken JSON", [b'{"text": "a"}', b"{oops"], [], ["cannot read", "nope.jsonl with datasets: JSON parse error"]),
    ("answer first", [{"messages": [{"role": "assistant", "content": "hi"}]}], [], ["answer before any prompt"]),
    ("bad max-tokens", [{"text": "a"}], ["--max-tokens", "1"], ["--max-tokens must be >= 2", "got 1"]),
]


@pytest.mark.parametrize("name,rows,extra,expect", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line(
    sft_inputs: Path, tmp_path: Path, name: str, rows: list[Any] | None, extra: list[str], expect: list[str]
) -> None:
    data = tmp_path / "nope.jsonl"
    if rows is not None:
        data.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    out = tmp_path / "o.bin"
    rc, _, err = _run(
        "prepare", "--input", str(data), "--output", str(out), "--tokenizer", str(sft_inputs / "tok"), *extra
    )
    assert rc == 1
    _one_line(err, expect)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["nope.jsonl"] if rows is not None else [])


def test_chat_without_a_template_is_one_line(sft_inputs: Path, tmp_path: Path) -> None:
    shutil.copytree(sft_inputs / "tok", tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    argv = ["prepare", "--input", str(sft_inputs / "chat.jsonl"), "--output", str(tmp_path / "o.bin")]
    rc, _, err = _run(*argv, "--tokenizer", str(tmp_path / "tok"))
    assert rc == 1
    _one_line(err, ["--format chat", "has no chat_template", "the model's own tokenizer folder"])
    rc, _, err = _run(*argv, "--tokenizer", "byte")
    _one_line(err, ["the byte tokenizer has none"])


def test_seq_len_shorter_than_the_longest_sample_is_one_line(sft_inputs: Path, tmp_path: Path) -> None:
    ds = _prepare(sft_inputs / "chat.jsonl", tmp_path / "sft.bin", sft_inputs / "tok", "--val-fraction", "0")
    longest = int(ds.meta["max_sample_tokens"])
    with pytest.raises(DataError) as info:
        check_samples_fit(ds, seq_len=64)
    line = str(info.value)
    assert "\n" not in line and f"has {longest} tokens but train.seq_len=64" in line
    assert f"set train.seq_len>={longest - 1}" in line and "--max-tokens 65" in line
    check_samples_fit(ds, seq_len=longest - 1)
    x, _ = get_batch(ds, seed=0, step=0, micro_batch=0, micro_batch_size=1, seq_len=longest - 1, rows_per_step=1)
    assert x.dtype == torch.int64 and np.all(x.numpy() >= 0)


STRICT_TEMPLATE = (  # ChatML that refuses unknown roles and, like reasoning templates, rewrites past answers
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\\n...<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_template_failures_are_bad_rows_of_their_own(sft_inputs: Path, tmp_path: Path) -> None:
    shutil.copytree(sft_inputs / "tok", tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": STRICT_TEMPLATE}))
    user, answer = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
    chats = [[user, answer], [user, {"role": "tool", "content": "x"}, answer], [user, answer, user, answer]]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    argv = ["prepare", "--input", str(tmp_path / "c.jsonl"), "--output", str(tmp_path / "o.bin"), "--quiet"]
    rc, out, err = _run(*argv, "--tokenizer", str(tmp_path / "tok"))
    assert rc == 0, err
    assert err.splitlines() == [
        "sysx data: 1 row skipped: template failure (first: row 2)",
        "sysx data: 1 row skipped: template not prefix-stable (first: row 3)",
    ]
    assert "1 sample (train 1)" in out
