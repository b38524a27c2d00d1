"""Tests of sysx.data: token files, tokenizers, `sysx data`, the default corpus, deterministic batches."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import platformdirs
import pytest
import torch
from test_runtime_procs import child_pythonpath

from sysx import cli
from sysx.data import (
    ByteTokenizer,
    DataError,
    TokenDataset,
    TokenWriter,
    cache_dir,
    default_corpus_path,
    dtype_for_vocab,
    ensure_default_corpus,
    get_batch,
)
from sysx.data.corpus import stdlib_sources
from sysx.data.prepare import main as data_main
from sysx.data.prepare import prepare

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own cache dir, so the user's cache is never touched."""
    path = tmp_path / "cache"
    monkeypatch.setenv("SYSX_CACHE_DIR", str(path))
    return path


def _write_token_file(path: Path, tokens: np.ndarray, vocab_size: int, val_fraction: float = 0.1) -> TokenDataset:
    with TokenWriter(path, vocab_size=vocab_size, tokenizer={"kind": "byte"}) as writer:
        writer.write(tokens)
        writer.finish(val_fraction=val_fraction)
    return TokenDataset(path)


@pytest.fixture
def dataset(tmp_path: Path) -> TokenDataset:
    tokens = np.random.default_rng(0).integers(0, 256, size=50_000)
    return _write_token_file(tmp_path / "toy.bin", tokens, vocab_size=256)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": child_pythonpath(os.environ)}


# ---------------------------------------------------------------- tokenizers and format


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓ 🐍\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids[:-3] + [0xF0]).endswith("\ufffd")  # a cut character decodes, not raises


def test_dtype_for_vocab() -> None:
    assert dtype_for_vocab(256) == "uint16"
    assert dtype_for_vocab(50257) == "uint16"
    assert dtype_for_vocab(65536) == "uint16"  # ids 0..65535 fit
    assert dtype_for_vocab(65537) == "uint32"
    assert dtype_for_vocab(128256) == "uint32"  # Llama 3
    with pytest.raises(DataError, match="vocab_size"):
        dtype_for_vocab(0)


def test_writer_publishes_atomically(tmp_path: Path) -> None:
    out = tmp_path / "t.bin"
    with pytest.raises(RuntimeError), TokenWriter(out, vocab_size=256, tokenizer={"kind": "byte"}) as writer:
        writer.write([1, 2, 3])
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []  # nothing published, temp file removed
    with TokenWriter(out, vocab_size=256, tokenizer={"kind": "byte"}) as writer:
        with pytest.raises(DataError, match="out of range"):
            writer.write([5, 256])
        writer.write([5, 255])
        meta = writer.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.meta.json"]
    assert meta["num_tokens"] == 2 and np.fromfile(out, dtype="<u2").tolist() == [5, 255]


# ---------------------------------------------------------------- sysx data prepare / info


def test_prepare_byte_from_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / ".git").mkdir()
    (src / "a.txt").write_text("hello world\n" * 100)
    (src / "sub" / "b.md").write_text("# héllo\nno newline at end")
    (src / ".git" / "config").write_text("hidden, skipped\n")
    (src / "blob.dat").write_bytes(b"\x00\x01binary")
    out = tmp_path / "out" / "corpus.bin"

    rc = data_main(["prepare", "--input", str(src), "--output", str(out), "--val-fraction", "0.1", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    report = capsys.readouterr()
    assert "skipped 1 binary" in report.err and "wrote" in report.out

    ds = TokenDataset(out)
    expected = ("hello world\n" * 100 + "# héllo\nno newline at end\n").encode()
    assert ds.dtype == "uint16" and ds.vocab_size == 256 and len(ds) == len(expected)
    assert bytes(np.asarray(ds.tokens, dtype=np.uint8)) == expected
    assert len(ds.split("train")) + len(ds.split("val")) == len(ds)
    assert len(ds.split("val")) == int(len(ds) * 0.1)
    assert ds.meta["source"]["files"] == 2

    # running again over the same dir (now holding the output) neither reads its own output nor changes
    assert data_main(["prepare", "--input", str(src), str(out.parent), "--output", str(out), "--quiet"]) == 0
    assert len(TokenDataset(out)) == len(expected)


def test_prepare_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "o.bin")
    assert data_main(["prepare", "--input", str(tmp_path / "missing"), "--output", out]) == 1
    assert "input not found" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    assert data_main(["prepare", "--input", str(tmp_path / "empty.txt"), "--output", out, "--quiet"]) == 1
    assert "empty" in capsys.readouterr().err
    (tmp_path / "x.txt").write_text("abc")
    assert data_main(["prepare", "--input", str(tmp_path / "x.txt"), "--output", str(tmp_path / "o.npy")]) == 1
    assert ".bin" in capsys.readouterr().err
    assert data_main(["prepare", "--input", str(tmp_path), "--output", out, "--glob", "*.rst"]) == 1
    assert "no input files matching *.rst" in capsys.readouterr().err
    assert data_main(["prepare", "--input", str(tmp_path / "x.txt"), "--output", out, "--val-fraction", "0.9"]) == 1
    assert "val_fraction" in capsys.readouterr().err
    assert data_main(["prepare", "--input", str(tmp_path / "x.txt"), "--output", out, "--tokenizer", "nope.json"]) == 1
    assert "tokenizer file not found" in capsys.readouterr().err
    assert not (tmp_path / "o.bin").exists()


def _word_tokenizer(path: Path, n_words: int) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<|endoftext|>": 0, "[UNK]": 1} | {f"w{i}": i + 2 for i in range(n_words)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


@pytest.mark.parametrize(("n_words", "dtype"), [(1000, "uint16"), (70_000, "uint32")])
def test_prepare_hf_tokenizer_picks_dtype(tmp_path: Path, n_words: int, dtype: str) -> None:
    tok_path = _word_tokenizer(tmp_path / "tokenizer.json", n_words)
    (tmp_path / "a.txt").write_text("w5 w7\nw999 w3\n")
    (tmp_path / "b.txt").write_text(f"w{n_words - 1} w0")
    out = tmp_path / "tok.bin"
    meta = prepare([tmp_path / "a.txt", tmp_path / "b.txt"], out, tokenizer=tok_path, val_fraction=0.0, progress=False)
    assert meta["dtype"] == dtype and meta["vocab_size"] == n_words + 2
    ds = TokenDataset(out)
    assert ds.tokens.dtype == np.dtype(dtype)
    assert ds.tokens.tolist() == [7, 9, 1001, 5, 0, n_words + 1, 2, 0]  # ids + <|endoftext|> after each file
    assert ds.splits == ["train"]
    assert ds.tokenizer().decode(ds.tokens[:4].tolist()) == "w5 w7 w999 w3"


def test_info_and_cli_dispatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.txt").write_text("print('hello, sysx')\n" * 50)
    out = tmp_path / "t.bin"
    assert cli.main(["data", "prepare", "--input", str(tmp_path / "t.txt"), "--output", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert cli.main(["data", "info", str(out), "--sample", "21", "--check"]) == 0
    text = capsys.readouterr().out
    assert "tokens:     1,050 (uint16" in text and "vocab_size: 256" in text
    assert "check:      ok" in text and "sha256:     ok" in text
    assert text.rstrip().endswith("print('hello, sysx')")
    with open(out, "r+b") as f:  # corrupt one token: --check notices
        f.write(b"\x00\x00")
    assert cli.main(["data", "info", str(out), "--check"]) == 1
    assert "sha256" in capsys.readouterr().err


# ---------------------------------------------------------------- nanoGPT files


def test_nanogpt_plain_bin(tmp_path: Path) -> None:
    train = np.random.default_rng(1).integers(0, 50257, size=5000).astype(np.uint16)
    val = np.random.default_rng(2).integers(0, 50257, size=501).astype(np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")

    with pytest.raises(DataError, match="no metadata.*data.dtype=uint16"):
        TokenDataset(tmp_path / "train.bin")
    with pytest.raises(DataError, match="vocab_size=50257"):
        TokenDataset(tmp_path / "train.bin", dtype="uint16")
    with pytest.raises(DataError, match="not a multiple of 4"):
        TokenDataset(tmp_path / "val.bin", dtype="uint32", vocab_size=50257)  # 1002 bytes: wrong dtype

    ds = TokenDataset(tmp_path, dtype="uint16", vocab_size=50257)  # a directory means its train.bin
    assert isinstance(ds.tokens, np.memmap) and len(ds) == 5000 and ds.splits == ["train", "val"]
    assert np.array_equal(ds.split("val"), val)
    x, y = get_batch(ds, seed=0, step=0, micro_batch=0, micro_batch_size=3, seq_len=64, split="val")
    assert x.shape == (3, 64) and torch.equal(x[:, 1:], y[:, :-1])

    lone = tmp_path / "lone.bin"
    train.tofile(lone)
    with pytest.raises(DataError, match="no 'val' split"):
        TokenDataset(lone, dtype="uint16", vocab_size=50257).split("val")


def test_nanogpt_meta_pkl(tmp_path: Path) -> None:
    chars = sorted(set("hello nanogpt\n"))
    itos = dict(enumerate(chars))
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": {c: i for i, c in itos.items()}}, f)
    ids = np.array([chars.index(c) for c in "hello nanogpt\n" * 20], dtype=np.uint16)
    ids.tofile(tmp_path / "train.bin")
    ds = TokenDataset(tmp_path / "train.bin")
    assert ds.vocab_size == len(chars) and ds.dtype == "uint16"
    assert ds.tokenizer().decode(ds.tokens[:14].tolist()) == "hello nanogpt\n"
    with pytest.raises(DataError, match="says dtype=uint16"):
        TokenDataset(tmp_path / "train.bin", dtype="uint32")

    class Evil:
        def __reduce__(self):  # would run code if unpickled naively
            return (os.system, ("true",))

    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 3, "x": Evil()}, f)
    with pytest.raises(DataError, match="only plain"):
        TokenDataset(tmp_path / "train.bin")


def test_metadata_mismatch_detected(tmp_path: Path) -> None:
    ds = _write_token_file(tmp_path / "m.bin", np.arange(100) % 256, vocab_size=256)
    with open(ds.path, "ab") as f:
        f.write(b"\x01\x00")
    with pytest.raises(DataError, match="101 tokens but .* says 100"):
        TokenDataset(tmp_path / "m.bin")


# ---------------------------------------------------------------- get_batch


def _batch(ds: TokenDataset, **kw: int | str) -> tuple[torch.Tensor, torch.Tensor]:
    args = dict(seed=7, step=3, micro_batch=1, micro_batch_size=4, seq_len=32) | kw
    return get_batch(ds, **args)


def test_get_batch_shapes_and_labels(dataset: TokenDataset) -> None:
    x, y = _batch(dataset)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(dataset.split("train")), 33)
    for row_x, row_y in zip(x.numpy(), y.numpy()):  # every row is a real window of the train split
        assert (windows == np.append(row_x, row_y[-1])).all(axis=1).any()


def test_get_batch_deterministic_and_distinct(dataset: TokenDataset) -> None:
    x, y = _batch(dataset)
    x2, y2 = _batch(TokenDataset(dataset.path))  # a fresh handle, as another rank would have
    assert torch.equal(x, x2) and torch.equal(y, y2)
    for change in ({"micro_batch": 2}, {"step": 4}, {"seed": 8}, {"dp_rank": 1, "dp_size": 2}, {"split": "val"}):
        assert not torch.equal(_batch(dataset, **change)[0], x), change
    ranks = [_batch(dataset, dp_rank=r, dp_size=2, micro_batch=0)[0] for r in range(2)]
    assert not torch.equal(ranks[0], ranks[1])


def test_get_batch_resumable(dataset: TokenDataset) -> None:
    seen = [_batch(dataset, step=s, micro_batch=m)[0] for s in range(6) for m in range(2)]
    resumed = TokenDataset(dataset.path)
    assert torch.equal(_batch(resumed, step=5, micro_batch=1)[0], seen[-1])
    assert torch.equal(_batch(resumed, step=4, micro_batch=0)[0], seen[8])


def test_get_batch_global_batch_independent_of_layout(dataset: TokenDataset) -> None:
    """dp=2 x 2 micro-batches x 2 rows covers the same 8 sequences as dp=1 x 1 micro-batch x 8 rows."""
    whole = _batch(dataset, micro_batch=0, micro_batch_size=8)[0]
    parts = [
        _batch(dataset, micro_batch=m, dp_rank=r, dp_size=2, micro_batch_size=2)[0] for m in range(2) for r in range(2)
    ]
    assert torch.equal(torch.cat(parts), whole)


def test_get_batch_errors(dataset: TokenDataset) -> None:
    n_val = len(dataset.split("val"))
    with pytest.raises(DataError, match=f"has {n_val} tokens but seq_len={n_val} needs at least {n_val + 1}"):
        _batch(dataset, split="val", seq_len=n_val)
    _batch(dataset, split="val", seq_len=n_val - 1)  # the largest window that fits
    with pytest.raises(DataError, match="dp_rank must be < dp_size=2"):
        _batch(dataset, dp_rank=2, dp_size=2)
    with pytest.raises(DataError, match="step must be >= 0"):
        _batch(dataset, step=-1)
    with pytest.raises(DataError, match="no 'test' split"):
        _batch(dataset, split="test")


_PRINT_BATCH = """
import hashlib, sys
from sysx.data import TokenDataset, get_batch
ds = TokenDataset(sys.argv[1])
x, y = get_batch(ds, seed=11, step=5, micro_batch=2, micro_batch_size=3, seq_len=40, dp_rank=1, dp_size=2)
print(hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow
def test_get_batch_same_in_separate_processes(dataset: TokenDataset) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PRINT_BATCH, str(dataset.path)],
            stdout=subprocess.PIPE,
            text=True,
            env=_env() | {"PYTHONHASHSEED": str(seed)},
        )
        for seed in (1, 2)
    ]
    digests = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    x, y = get_batch(dataset, seed=11, step=5, micro_batch=2, micro_batch_size=3, seq_len=40, dp_rank=1, dp_size=2)
    import hashlib

    assert digests[0] == digests[1] == hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------- default corpus


def test_default_corpus_built_once_and_cached(_private_cache: Path) -> None:
    path, built = ensure_default_corpus()
    assert built and path.parent == _private_cache / "data" and path == default_corpus_path()
    mtime = path.stat().st_mtime_ns
    assert ensure_default_corpus() == (path, False) and path.stat().st_mtime_ns == mtime

    ds = TokenDataset(path)
    assert ds.vocab_size == 256 and ds.dtype == "uint16" and ds.meta["tokenizer"]["kind"] == "byte"
    assert 2_000_000 < len(ds) <= 12 * 2**20, len(ds)  # non-trivial, capped
    assert 0 < len(ds.split("val")) <= 0.02 * len(ds)
    head = ByteTokenizer().decode(ds.tokens[:4000].tolist())
    assert head.startswith("# ==== ") and "def " in head

    with open(path, "r+b") as f:  # a truncated cache file is rebuilt, not used
        f.truncate(1000)
    assert ensure_default_corpus() == (path, True)
    assert len(TokenDataset(path)) == len(ds)


def test_default_corpus_source_selection(tmp_path: Path) -> None:
    root = tmp_path / "lib"
    for rel in (
        "a.py",
        "pkg/b.py",
        "test/t.py",
        "pkg/tests/t.py",
        "site-packages/x.py",
        "_sysconfigdata_x.py",
        "c.txt",
        "z.py",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\n" + "x = 1\n" * 20)
    assert [rel for rel, _ in stdlib_sources(root, max_bytes=10_000)] == ["a.py", "pkg/b.py", "z.py"]
    assert [rel for rel, _ in stdlib_sources(root, max_bytes=300)] == ["a.py", "pkg/b.py"]  # capped in order
    path, built = ensure_default_corpus(root=root, max_bytes=300)
    text = ByteTokenizer().decode(TokenDataset(path).tokens.tolist())
    assert built and text.startswith("# ==== a.py ====\n# a.py\nx = 1\n") and "# ==== pkg/b.py ====" in text
    with pytest.raises(DataError, match="only .* bytes of .py sources"):
        ensure_default_corpus(root=root / "pkg")


def test_cache_dir_defaults_to_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SYSX_CACHE_DIR")
    assert cache_dir() == Path(platformdirs.user_cache_dir("sysx")) / "data"


_BUILD_AT = """
import json, sys, time
from sysx.data.corpus import ensure_default_corpus
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))  # start both builds at the same instant
path, built = ensure_default_corpus()
print(json.dumps({"path": str(path), "built": built}))
"""


@pytest.mark.slow
def test_default_corpus_concurrent_build(_private_cache: Path) -> None:
    start_at = str(time.time() + 1.5)
    procs = [
        subprocess.Popen([sys.executable, "-c", _BUILD_AT, start_at], stdout=subprocess.PIPE, text=True, env=_env())
        for _ in range(2)
    ]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert results[0]["path"] == results[1]["path"]
    assert sorted(r["built"] for r in results) == [False, True]  # one built, the other waited and reused it
    path = Path(results[0]["path"])
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == sorted([path.name, path.stem + ".meta.json", path.stem + ".lock"])  # no temp files left
    ds = TokenDataset(path)
    assert ensure_default_corpus() == (path, False) and len(ds) == ds.meta["num_tokens"]
