"""``sysx data prepare`` for instruction data: rows (JSONL, Parquet, Arrow, saved datasets) -> a sample file.

Rows are visited in a permutation drawn from ``--seed``, and samples are written in that order, so
the val split (the last ``--val-fraction`` of samples) is a random subset rather than one source
file's tail. Bad rows are counted per kind, never dropped silently; the packing measurement of
:mod:`sysx.data.packing` goes into the metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from sysx.data.chat_mask import BadRow
from sysx.data.errors import DataError
from sysx.data.packing import auto_seq_lens, measure_packing
from sysx.data.row_samples import BadRows, Fields, resolve_format, row_sample
from sysx.data.rows import load_rows
from sysx.data.sample_format import SampleWriter
from sysx.data.sample_tokenizer import SampleTokenizer, load_sample_tokenizer
from sysx.data.tokenizer import keep_tokenizer_files


def _check_tokenizer(tok: SampleTokenizer, fmt: str, spec: str | Path) -> None:
    if fmt == "chat" and not tok.has_chat_template:
        what = "the byte tokenizer has none" if tok.hf is None else "its tokenizer_config.json has no chat_template"
        raise DataError(
            f"--format chat renders messages with the model's chat template, but --tokenizer {spec}: {what}; "
            "give the model's own tokenizer folder (or --format prompt-completion)"
        )


def _all_bad(bad: BadRows, rows: int) -> DataError:
    kinds = "; ".join(line.replace(" skipped", "") for line in bad.lines())
    return DataError(f"all {rows} input rows are bad, no sample to write: {kinds}")


def prepare_samples(
    inputs: Sequence[str | Path],
    output: str | Path,
    *,
    tokenizer: str | Path,
    fmt: str = "auto",
    fields: Fields | None = None,
    max_tokens: int | None = None,
    val_fraction: float = 0.01,
    seed: int = 0,
    seq_lens: Sequence[int] | None = None,
    progress: bool = True,
) -> tuple[dict[str, Any], BadRows]:
    """Tokenize instruction rows into the sample file ``output``; returns its metadata and the bad rows."""
    output = Path(output).expanduser()
    if output.suffix != ".bin":
        raise DataError(f"--output must name a .bin file, got {output}")
    if max_tokens is not None and max_tokens < 2:
        raise DataError(f"--max-tokens must be >= 2 (a prompt token and a trained one), got {max_tokens}")
    tok = load_sample_tokenizer(tokenizer)
    rows = load_rows(inputs)
    fields = fields or Fields()
    fmt = resolve_format(fmt, list(rows.column_names), fields)
    _check_tokenizer(tok, fmt, tokenizer)
    if len(rows) == 0:
        raise DataError(f"the inputs ({', '.join(map(str, inputs))}) hold no rows")
    bad = BadRows()
    lengths: list[int] = []
    targets: list[int] = []
    order = np.random.default_rng(seed).permutation(len(rows))
    with SampleWriter(output, vocab_size=tok.vocab_size, tokenizer=tok.describe()) as writer:
        for index in tqdm(order, unit="row", desc="preparing", delay=0.5, disable=not progress):
            try:
                ids, mask = row_sample(_row(rows, int(index)), fmt, fields, tok)
                if max_tokens is not None and len(ids) > max_tokens:
                    raise BadRow(f"over-long (> --max-tokens {max_tokens})")
            except BadRow as exc:
                bad.add(exc.kind, int(index) + 1)
                continue
            writer.write_sample(ids, mask)
            lengths.append(len(ids))
            targets.append(int(mask[1:].sum()))
        if writer.num_samples == 0:
            raise _all_bad(bad, len(rows))
        measured = list(seq_lens) if seq_lens else auto_seq_lens(writer.max_sample_tokens)
        source = {"kind": "rows", "inputs": [str(Path(i).expanduser().resolve()) for i in inputs], "rows": len(rows)}
        meta = writer.finish(
            val_fraction=val_fraction,
            source=source,
            pad_id=tok.pad_id,
            sample_format=fmt,
            shuffle_seed=seed,
            bad_rows={kind: {"count": n, "first_row": first} for kind, (n, first) in bad.kinds.items()},
            packing=measure_packing(np.array(lengths), np.array(targets), measured),
        )
    if tok.path is not None and tok.path.is_file():
        keep_tokenizer_files(tok.path, output)
    return meta, bad


def _row(rows: Any, index: int) -> dict[str, Any]:
    try:
        return dict(rows[index])
    except UnicodeDecodeError:  # pyarrow keeps a JSON string's invalid UTF-8 until the row is read
        raise BadRow("bad UTF-8") from None
