"""``sysx data``: make token files from text (``prepare``), inspect them (``info``), build the default corpus.

sysx data prepare --input FILES_OR_DIRS... --output out.bin [--tokenizer byte|tokenizer.json] [--val-fraction 0.01]
sysx data prepare --input chats.jsonl|*.parquet|*.arrow|SAVED_DIR --output sft.bin --tokenizer HF_FOLDER
    [--format auto|text|prompt-completion|chat] [--max-tokens N] [--seed 0]   (a sample file: see prepare_samples)
sysx data info PATH [--dtype uint16 --vocab-size N] [--sample 200] [--check]
sysx data default
"""

from __future__ import annotations

import argparse
import codecs
import fnmatch
import hashlib
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from sysx.data.corpus import ensure_default_corpus
from sysx.data.dataset import TokenDataset
from sysx.data.errors import DataError
from sysx.data.format import TokenWriter, meta_path_for
from sysx.data.packing import packing_line
from sysx.data.prepare_samples import prepare_samples
from sysx.data.row_samples import FORMATS, Fields
from sysx.data.rows import is_row_input
from sysx.data.tokenizer import ByteTokenizer, HFTokenizer, keep_tokenizer_files, load_tokenizer

CHUNK_BYTES = 1 << 20  # text is read and tokenized in ~1 MiB pieces cut at line ends
SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a file as binary (skipped)


def collect_inputs(inputs: Sequence[str | Path], globs: Sequence[str] = (), exclude: Sequence[Path] = ()) -> list[Path]:
    """Files named by ``inputs``: files as given, directories walked recursively (sorted, hidden entries skipped).

    ``globs`` (e.g. ``*.txt``) filter files found in directories; ``exclude`` paths are never taken.
    """
    excluded = {p.resolve() for p in exclude}
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_file():
            candidates = [path]
        elif path.is_dir():
            candidates = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
                and (not globs or any(fnmatch.fnmatch(p.name, g) for g in globs))
            )
        else:
            raise DataError(f"input not found: {path}")
        files += [p for p in candidates if p.resolve() not in excluded]
    if not files:
        where = ", ".join(map(str, inputs))
        pattern = f" matching {', '.join(globs)}" if globs else ""
        raise DataError(f"no input files{pattern} found in {where}")
    return files


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(SNIFF_BYTES)


def _read_chunks(path: Path) -> Iterator[bytes]:
    """The file's bytes in pieces of about CHUNK_BYTES, each ending at a line end where possible."""
    rest = b""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK_BYTES), b""):
            data = rest + block
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # one very long line: pass it on whole-chunk
                cut = len(data)
            rest = data[cut:]
            yield data[:cut]
    if rest:
        yield rest


def _resolve_eos(tok: ByteTokenizer | HFTokenizer, eos: str) -> int | None:
    if eos == "none":
        return None
    if isinstance(tok, ByteTokenizer):
        if eos != "auto":
            raise DataError("--eos TOKEN needs a tokenizer.json; the byte tokenizer has no special tokens")
        return None
    if eos == "auto":
        return tok.eos_id()
    found = tok.token_to_id(eos)
    if found is None:
        raise DataError(f"--eos {eos!r} is not in the vocabulary of {tok.path}; use `--eos none` or another token")
    return found


def prepare(
    inputs: Sequence[str | Path],
    output: str | Path,
    *,
    tokenizer: str | Path = "byte",
    val_fraction: float = 0.01,
    globs: Sequence[str] = (),
    eos: str = "auto",
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize text files into ``output`` (+ ``<stem>.meta.json``); returns the metadata.

    Documents are files; the byte tokenizer ends each with a newline, a tokenizer.json with its
    end-of-text token (``eos="auto"`` finds one, ``"none"`` adds nothing, or name a token).
    """
    output = Path(output).expanduser()
    if output.suffix != ".bin":
        raise DataError(f"--output must name a .bin file, got {output}")
    tok = load_tokenizer(tokenizer)
    eos_id = _resolve_eos(tok, eos)
    files = collect_inputs(inputs, globs, exclude=[output, meta_path_for(output)])
    binary = {p for p in files if _is_binary(p)}
    texts = [p for p in files if p not in binary]
    skipped = sorted(binary)
    if not texts:
        raise DataError(f"all {len(files)} input files look binary (contain NUL bytes); give text files")
    total = sum(p.stat().st_size for p in texts)
    desc = tok.describe() | {"eos_id": eos_id}
    bad_utf8 = 0
    source_hash = hashlib.sha256()
    with TokenWriter(output, vocab_size=tok.vocab_size, tokenizer=desc) as writer:
        with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", delay=0.5, disable=not progress) as bar:
            for path in texts:
                source_hash.update(str(path).encode() + b"\0")
                decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
                last = b""
                replaced = False
                for chunk in _read_chunks(path):
                    source_hash.update(chunk)
                    if isinstance(tok, ByteTokenizer):
                        writer.write(np.frombuffer(chunk, dtype=np.uint8))
                    else:
                        text = decoder.decode(chunk)
                        replaced |= "\ufffd" in text
                        writer.write(np.asarray(tok.encode(text), dtype=np.int64))
                    last = chunk[-1:]
                    bar.update(len(chunk))
                if not isinstance(tok, ByteTokenizer):
                    tail = decoder.decode(b"", final=True)
                    replaced |= "\ufffd" in tail
                    writer.write(np.asarray(tok.encode(tail), dtype=np.int64))
                    bad_utf8 += replaced
                if eos_id is not None:
                    writer.write([eos_id])
                elif isinstance(tok, ByteTokenizer) and last not in (b"", b"\n"):
                    writer.write([ord("\n")])
        source = {
            "kind": "files",
            "inputs": [str(Path(i).expanduser().resolve()) for i in inputs],
            "files": len(texts),
            "bytes": total,
            "sha256": source_hash.hexdigest(),
        }
        meta = writer.finish(val_fraction=val_fraction, source=source)
    if isinstance(tok, HFTokenizer):
        keep_tokenizer_files(tok.path, output)
    if skipped:
        print(f"skipped {len(skipped)} binary file(s), e.g. {skipped[0]}", file=sys.stderr)
    if bad_utf8:
        print(f"{bad_utf8} file(s) had invalid UTF-8; those bytes became U+FFFD before tokenizing", file=sys.stderr)
    return meta


def info(
    path: str | Path,
    *,
    dtype: str | None = None,
    vocab_size: int | None = None,
    split: str = "train",
    sample: int = 200,
    check: bool = False,
) -> str:
    """A human-readable summary of a token file: counts, dtype, vocab, splits, source, a decoded sample."""
    ds = TokenDataset(path, dtype=dtype, vocab_size=vocab_size)
    tok_desc = {k: v for k, v in (ds.meta.get("tokenizer") or {}).items() if k != "itos"}
    lines = [
        f"path:       {ds.path}",
        f"metadata:   {ds.meta_source or '(none: dtype/vocab from arguments)'}",
        f"tokens:     {len(ds):,} ({ds.dtype}, {ds.tokens.nbytes / 1e6:.1f} MB)",
        f"vocab_size: {ds.vocab_size:,}",
        f"tokenizer:  {tok_desc or 'unknown'}",
        "splits:     " + ", ".join(f"{name} {len(ds.split(name)):,}" for name in ds.splits),
    ]
    if ds.meta.get("source"):
        lines.append(f"source:     {ds.meta['source']}")
    if check:
        top = ds.max_token()
        if top >= ds.vocab_size:
            raise DataError(f"{ds.path} holds token id {top} >= vocab_size {ds.vocab_size}: wrong vocab_size or dtype")
        lines.append(f"check:      ok (max id {top} < vocab_size {ds.vocab_size})")
        if ds.meta.get("sha256") and ds.meta_source == meta_path_for(ds.path):
            digest = hashlib.sha256()
            for i in range(0, len(ds.tokens), 1 << 24):
                digest.update(np.ascontiguousarray(ds.tokens[i : i + (1 << 24)]).tobytes())
            if digest.hexdigest() != ds.meta["sha256"]:
                raise DataError(
                    f"{ds.path} does not match the sha256 in {ds.meta_source}: the file changed; rebuild it"
                )
            lines.append("sha256:     ok")
    if ds.has_loss_mask:
        return "\n".join(lines + _sample_lines(ds, split, sample))
    ids = [int(i) for i in ds.split(split)[:sample]]
    tok = ds.tokenizer()
    body = tok.decode(ids) if tok is not None else f"(no tokenizer available; ids) {ids}"
    lines += [f"sample ({split}, first {len(ids)} tokens):", body]
    return "\n".join(lines)


def _sample_lines(ds: TokenDataset, split: str, max_tokens: int) -> list[str]:
    """A sample file's counts and its split's first sample decoded, the trained tokens between [[ ]]."""
    index = ds.samples
    assert index is not None
    ds.split(split)  # the usual error for a missing split
    first, end = index.split_range(split)
    lengths = index.lengths
    trained = int(ds.meta.get("trained_tokens", int(index.targets.sum())))
    lines = [
        f"samples:    {index.num_samples:,} ("
        + ", ".join(f"{name} {b - a:,}" for name, (a, b) in index.ranges.items())
        + f"); format {ds.meta.get('sample_format', '?')}, pad id {index.pad_id}",
        f"trained:    {trained:,} of {len(ds):,} tokens ({trained / len(ds):.1%}) are loss targets",
        f"length:     max {int(lengths.max()):,}, mean {float(lengths.mean()):.1f} tokens per sample",
    ]
    lines += [f"packing:    {packing_line(entry)}" for entry in ds.meta.get("packing", [])]
    if first == end:
        return [*lines, f"(split {split!r} has no samples)"]
    start = int(index.offsets[first])
    stop = min(int(index.offsets[first + 1]), start + max_tokens)
    ids = [int(i) for i in ds.tokens[start:stop]]
    bits = [int(b) for b in index.mask[start:stop]]
    tok = ds.tokenizer()
    if tok is None:
        body = " ".join(f"[[{i}]]" if b else str(i) for i, b in zip(ids, bits, strict=True))
    else:  # decode runs of equal mask bits, so the marks fall between tokens
        runs, k = [], 0
        while k < len(ids):
            j = k
            while j < len(ids) and bits[j] == bits[k]:
                j += 1
            text = tok.decode(ids[k:j])
            runs.append(f"[[{text}]]" if bits[k] else text)
            k = j
        body = "".join(runs)
    return [*lines, f"sample {first} ({split}, {stop - start} tokens; trained tokens between [[ ]]):", body]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sysx data", description="Token files: prepare, inspect, default corpus.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{prepare,info,default}")
    p = sub.add_parser(
        "prepare", help="tokenize text files, or instruction rows with a loss mask, into a .bin (+ .meta.json)"
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="text files and/or directories of them, or instruction rows: JSONL, Parquet, Arrow files, save_to_disk folders",
    )
    p.add_argument("--output", required=True, metavar="OUT.bin", help="token file to write")
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="`byte` (default), a local tokenizer.json, or a model folder (its chat template renders chats)",
    )
    p.add_argument("--val-fraction", type=float, default=0.01, help="last fraction of tokens kept as the val split")
    p.add_argument(
        "--glob", action="append", default=[], metavar="PATTERN", help="only files matching (repeatable), e.g. '*.txt'"
    )
    p.add_argument("--eos", default="auto", help="token appended after each file: auto | none | a token string")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    rows = p.add_argument_group("instruction data (JSONL, Parquet, Arrow, save_to_disk folders -> a sample file)")
    rows.add_argument("--format", help=f"{' | '.join(FORMATS)} (default auto for those inputs)")
    rows.add_argument("--text-field", default="text", help="column of a text row (every token trained)")
    rows.add_argument("--prompt-field", default="prompt", help="column of a prompt (not trained)")
    rows.add_argument("--completion-field", default="completion", help="column of a completion (trained)")
    rows.add_argument("--messages-field", default="messages", help="column of chat messages [{role, content}]")
    rows.add_argument("--max-tokens", type=int, help="samples longer than this are bad rows (over-long)")
    rows.add_argument("--seed", type=int, default=0, help="seed of the shuffle deciding the val samples")
    rows.add_argument(
        "--seq-lens", help="comma list of seq_lens to measure packing at (default: the longest sample's, 2x, 4x)"
    )
    i = sub.add_parser("info", help="print token count, dtype, vocab, splits and a decoded sample")
    i.add_argument("path", help="a .bin token file or a directory holding train.bin")
    i.add_argument("--dtype", choices=["uint16", "uint32"], help="for files without metadata")
    i.add_argument("--vocab-size", type=int, help="for files without metadata")
    i.add_argument("--split", default="train")
    i.add_argument("--sample", type=int, default=200, help="tokens to decode")
    i.add_argument("--check", action="store_true", help="scan all ids (< vocab_size) and verify the sha256")
    sub.add_parser("default", help="build (once) the default stdlib byte corpus and print its path")
    return parser


def _seq_lens(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise DataError(f"--seq-lens {text!r} must be a comma list of positive ints, e.g. 512,1024,2048")
    return values


def _prepare_rows(args: argparse.Namespace) -> None:
    """``sysx data prepare`` on instruction rows: the sample file, one line per bad-row kind, the summary."""
    text_inputs = [i for i in args.input if not is_row_input(i)]
    if text_inputs:
        raise DataError(
            f"--input {text_inputs[0]} is not JSONL, Parquet, Arrow or a save_to_disk folder; instruction data "
            "(--format, .jsonl/.parquet/.arrow inputs) and text files are prepared by separate commands"
        )
    start = time.perf_counter()
    fields = Fields(args.text_field, args.prompt_field, args.completion_field, args.messages_field)
    meta, bad = prepare_samples(
        args.input,
        args.output,
        tokenizer=args.tokenizer,
        fmt=args.format or "auto",
        fields=fields,
        max_tokens=args.max_tokens,
        val_fraction=args.val_fraction,
        seed=args.seed,
        seq_lens=_seq_lens(args.seq_lens),
        progress=not args.quiet,
    )
    for line in bad.lines():
        print(f"sysx data: {line}", file=sys.stderr)
    for entry in meta["packing"]:
        print(f"packing at {packing_line(entry)}")
    splits = ", ".join(f"{k} {b - a:,}" for k, (a, b) in meta["sample_splits"].items())
    print(
        f"wrote {args.output}: {meta['num_samples']:,} sample{'s' * (meta['num_samples'] != 1)} ({splits}), {meta['num_tokens']:,} tokens, "
        f"{meta['trained_tokens']:,} trained ({meta['trained_tokens'] / meta['num_tokens']:.0%}; "
        f"{meta['sample_format']}, longest {meta['max_sample_tokens']:,}) from {meta['source']['rows']:,} rows, "
        f"{bad.total:,} bad, in {time.perf_counter() - start:.1f} s"
    )


def main(argv: list[str]) -> int:
    """Entry point of ``sysx data``."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help or a usage error
        return int(exc.code or 0)
    try:
        if args.cmd == "prepare" and (args.format is not None or any(is_row_input(i) for i in args.input)):
            _prepare_rows(args)
        elif args.cmd == "prepare":
            start = time.perf_counter()
            meta = prepare(
                args.input,
                args.output,
                tokenizer=args.tokenizer,
                val_fraction=args.val_fraction,
                globs=args.glob,
                eos=args.eos,
                progress=not args.quiet,
            )
            splits = ", ".join(f"{k} {b - a:,}" for k, (a, b) in meta["splits"].items())
            print(
                f"wrote {args.output}: {meta['num_tokens']:,} tokens ({meta['dtype']}, vocab {meta['vocab_size']:,}; "
                f"{splits}) from {meta['source']['files']} file(s) in {time.perf_counter() - start:.1f} s"
            )
        elif args.cmd == "info":
            print(
                info(
                    args.path,
                    dtype=args.dtype,
                    vocab_size=args.vocab_size,
                    split=args.split,
                    sample=args.sample,
                    check=args.check,
                )
            )
        else:
            start = time.perf_counter()
            path, built = ensure_default_corpus(progress=True)
            state = f"built in {time.perf_counter() - start:.1f} s" if built else "cached"
            print(f"{path} ({state})")
            print(info(path, sample=120))
    except DataError as exc:
        print(f"sysx data: error: {exc}", file=sys.stderr)
        return 1
    return 0
