"""What not packing costs: row positions and targets per step, unpacked vs first-fit packing, measured.

sysx trains one sample per row (see :mod:`sysx.data.sample_batch`). ``measure_packing`` says what
that costs on a given sample set: unpacked, a row of ``seq_len`` positions holds one sample and
padding; packed (first-fit of the samples into rows, with positions restarting per sample and a
block-diagonal causal mask), fewer rows hold the same samples. The ratio of rows is the factor
packing would multiply the tokens (and trained tokens) of a step by. A sample occupies
``min(length, seq_len)`` positions either way (its last token's label, if any, is the next
sample's first token, never trained).
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_MEASURED = 10_000  # first-fit over more samples than this measures a (random, shuffled) prefix of them


def first_fit_rows(sizes: np.ndarray, capacity: int) -> int:
    """Rows first-fit packing needs for ``sizes`` (each <= capacity), in the given order."""
    free = np.empty(len(sizes), dtype=np.int64)
    rows = 0
    for size in sizes:
        fits = np.flatnonzero(free[:rows] >= size)
        if fits.size:
            free[fits[0]] -= size
        else:
            free[rows] = capacity - size
            rows += 1
    return rows


def auto_seq_lens(max_sample_tokens: int) -> list[int]:
    """The smallest power of two holding the longest sample (``seq_len + 1 >= tokens``), and 2x and 4x it."""
    base = 1 << max(int(max_sample_tokens) - 2, 0).bit_length()
    return [base, 2 * base, 4 * base]


def measure_packing(lengths: np.ndarray, targets: np.ndarray, seq_lens: list[int]) -> list[dict[str, Any]]:
    """Per ``seq_len``: samples that fit, fill of row positions and targets per row, unpacked and packed."""
    lengths, targets = np.asarray(lengths, np.int64)[:MAX_MEASURED], np.asarray(targets, np.int64)[:MAX_MEASURED]
    report = []
    for seq_len in seq_lens:
        fit = lengths <= seq_len + 1
        sizes = np.minimum(lengths[fit], seq_len)
        rows_unpacked = int(fit.sum())
        rows_packed = first_fit_rows(sizes, seq_len) if rows_unpacked else 0
        used, trained = int(sizes.sum()), int(targets[fit].sum())
        report.append(
            {
                "seq_len": int(seq_len),
                "samples_measured": rows_unpacked,
                "samples_too_long": int((~fit).sum()),
                "unpacked_fill": used / max(rows_unpacked * seq_len, 1),
                "packed_fill": used / max(rows_packed * seq_len, 1),
                "packed_tokens_factor": rows_unpacked / max(rows_packed, 1),
                "unpacked_trained_per_row": trained / max(rows_unpacked, 1),
                "packed_trained_per_row": trained / max(rows_packed, 1),
            }
        )
    return report


def packing_line(entry: dict[str, Any]) -> str:
    """``"seq_len 512: unpacked, 41% of row positions hold a sample; packed would fill 97%, 2.4x the tokens per step"``."""
    too_long = f" ({entry['samples_too_long']} samples longer than a row)" if entry["samples_too_long"] else ""
    return (
        f"seq_len {entry['seq_len']}: unpacked, {entry['unpacked_fill']:.0%} of row positions hold a sample "
        f"({entry['unpacked_trained_per_row']:.0f} trained tokens per row); packed would fill "
        f"{entry['packed_fill']:.0%}, {entry['packed_tokens_factor']:.1f}x the tokens per step{too_long}"
    )
