"""The planner's sequence-chunk length ``C`` (``single.seq_chunk``) and the device bytes chunking adds.

When one sequence's transient workspace is too large for the device, the sliding window runs each
block on chunks of ``C`` tokens along the sequence (:mod:`sysx.model.attention`). ``single.seq_chunk=0``
(auto) keeps whole sequences when they fit, else takes the largest divisor of ``train.seq_len`` whose
workspace fits.
"""

from __future__ import annotations

from collections.abc import Callable

from sysx.single.plan_costs import LevelTable
from sysx.single.plan_request import PlanError, PlanRequest, gib
from sysx.single.rings import align

Table = Callable[[int, int], LevelTable]  # (sequences per chunk, sequence-chunk length) -> level table


def kv_cache_bytes(req: PlanRequest, sequences: int, seq_chunk: int) -> dict[str, int]:
    """Device bytes of the K/V cache of ``sequences`` sequences and its fp32 gradients (none unchunked)."""
    if seq_chunk >= req.seq_len:
        return {}
    cfg = req.model
    elements = 2 * sequences * req.seq_len * cfg.n_kv_heads * cfg.head_dim  # keys and values
    return {"K/V cache": align(elements * req.param_bytes), "K/V grads (fp32)": align(elements * 4)}


def _divisors_below(n: int) -> list[int]:
    return [d for d in range(n - 1, 0, -1) if n % d == 0]


def choose_seq_chunk(req: PlanRequest, table: Table, room: float) -> tuple[int, str]:
    """``C`` and why: pinned by ``single.seq_chunk``, else whole sequences or the largest divisor of
    ``train.seq_len`` whose one-sequence workspace fits ``room`` (see docs/architecture.md)."""
    S, b = req.seq_len, req.chunk or 1
    if req.seq_chunk:
        if S % req.seq_chunk:
            raise PlanError(
                f"single.seq_chunk={req.seq_chunk} must divide train.seq_len={S}; divisors: "
                f"{sorted([S, *_divisors_below(S)])}"
            )
        if req.seq_chunk == S:
            return S, "sequence chunks: none (single.seq_chunk = train.seq_len)"
        return req.seq_chunk, (
            f"sequence chunks: {S // req.seq_chunk} chunks of {req.seq_chunk} tokens per sequence "
            f"(single.seq_chunk)" + _kv_note(req, b, req.seq_chunk)
        )
    whole = table(b, S).workspace_bytes
    if whole <= room:
        return S, (
            f"sequence chunks: none: the workspace of {b} whole sequence(s) ({gib(whole)}) fits the workspace "
            f"room {gib(room)}"
        )
    best, best_ws = S, whole
    for C in _divisors_below(S):
        ws = table(b, C).workspace_bytes
        if ws <= room:
            best, best_ws = C, ws
            break
        if ws < best_ws:  # no size fits: the smallest workspace (the head's may bound it from below)
            best, best_ws = C, ws
    fits = "fits" if best_ws <= room else "the least of any chunk length: the head's share does not shrink with them"
    return best, (
        f"sequence chunks: the workspace of {b} whole sequence(s) of {S} tokens ({gib(whole)}) is more than the "
        f"workspace room {gib(room)}; chunks of {best} tokens need {gib(best_ws)} ({fits}) -> {S // best} chunks "
        f"per sequence, each attending over the K/V of the chunks before it" + _kv_note(req, b, best)
    )


def _kv_note(req: PlanRequest, b: int, seq_chunk: int) -> str:
    kv = kv_cache_bytes(req, b, seq_chunk)
    return "; on the device: " + ", ".join(f"{k} {gib(v)}" for k, v in kv.items()) if kv else ""
