"""The search's answer for people (a table and reasons) and for programs (a JSON-ready dict)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from sysx.autotune.advice import Change
from sysx.autotune.search import RESOURCES, Candidate, Result

GiB = float(1 << 30)


def _row(i: int | str, c: Candidate, scale: float) -> str:
    p = c.gpu_parts
    mem = [c.gpu, p["params"], p["grads"], p["ckpts"], p["work"], c.host, c.shm]
    cols = " ".join(f"{x / scale:>{w}.2f}" for x, w in zip(mem, (7, 7, 6, 6, 6, 7, 6)))
    return f"{i!s:>3} {c.iteration:>9.4g} {100 * c.bubble:>6.1f}% {cols}  {c.label()}"


def table(cands: list[Candidate], top: int) -> str:
    """The first ``top`` candidates: predicted time, bubble, GPU memory per component, host, shm
    (in GiB, or MiB when every figure is under a GiB)."""
    shown = cands[:top]
    big = max((max(c.gpu, c.host, c.shm) for c in shown), default=0.0) >= GiB
    scale, u = (GiB, "GiB") if big else (float(1 << 20), "MiB")
    head = (
        f"{'#':>3} {'iter s':>9} {'bubble':>7} {'GPU ' + u:>7} {'params':>7} {'grads':>6} {'ckpts':>6} {'work':>6} "
        f"{'host ' + u:>7} {'shm ' + u:>6}  options"
    )
    return "\n".join([head] + [_row(i + 1, c, scale) for i, c in enumerate(shown)])


def speedup(fast_s: float, slow_s: float) -> float:
    """How many times faster ``fast_s`` seconds per iteration are than ``slow_s`` (a ratio of times, never a
    percentage of the slower time: 0.431 s against 2.063 s is 4.79x, not "79% faster")."""
    return slow_s / fast_s if fast_s > 0 else float("inf")


def global_batch_phrase(result: Result) -> str:
    """The job's global batch as every candidate keeps it, split into its replicas when there are
    several: fixed (``parallel.replicas``) for every candidate, or the winner's when the search chose."""
    n = result.job.global_batch
    total = f"global batch {n} sequences"
    fixed = result.job.replicas
    if fixed is not None:
        return total + (f" ({fixed} replicas x {n // fixed} sequences)" if fixed > 1 else "") + " in every candidate"
    chosen = result.best or result.closest
    if chosen is None or chosen.replicas == 1:
        return total + " in every candidate"
    what = "the winner's" if result.best is not None else "the closest's"
    return f"{total} in every candidate ({what}: {chosen.replicas} replicas x {n // chosen.replicas} sequences)"


def why(result: Result, baseline: Candidate | str | None) -> list[str]:
    """Sentences on why the winner won (or, when nothing fits, on what is closest)."""
    over = Counter(max(RESOURCES, key=lambda r: c.over[r]) for c in result.rejected)
    rejected = ", ".join(f"{n} over the {r} budget" for r, n in sorted(over.items())) or "none over budget"
    lines = [
        f"{len(result.fitting)} of {len(result.fitting) + len(result.rejected)} buildable candidates fit "
        f"({rejected}); {len(result.invalid)} could not be built (too few layers for the stages, or too few "
        f"micro-batches for the ranks); {global_batch_phrase(result)}"
    ]
    best = result.best
    if best is None:
        c = result.closest
        if c is not None:
            lines.append(
                f"nothing fits; closest: `{c.label()}` needs "
                + ", ".join(f"{r} {100 * c.over[r]:.0f}%" for r in RESOURCES if r != "disk" or c.over[r])
                + " of the budget"
            )
        return lines
    disk = f" ({best.exposed_io:.3g} s of it disk I/O the step cannot hide)" if best.exposed_io else ""
    lines.append(
        f"winner `{best.label()}`: predicted {best.iteration:.4g} s per iteration{disk}, bubble {100 * best.bubble:.1f}%"
    )
    faster = [c for c in result.fitting[1:] if c.iteration < best.iteration]
    if faster:  # fewest_instructions_first put it ahead: say what it was preferred to
        f = min(faster, key=lambda c: c.iteration)
        lines.append(
            f"preferred to `{f.label()}` ({f.iteration:.4g} s, {speedup(f.iteration, best.iteration):.3g}x faster in "
            f"plan): a tie within the model's error, and fewer instructions a step ({best.instructions} against "
            f"{f.instructions})"
        )
    slower = [c for c in result.fitting[1:] if c.iteration > best.iteration]
    if slower:
        r = slower[0]
        gain = speedup(best.iteration, r.iteration)
        lead = f"{gain:.3g}x faster than" if gain >= 1.001 else "within 0.1% of (a tie; less memory decided)"
        lines.append(f"{lead} the next slower, `{r.label()}` ({r.iteration:.4g} s, bubble {100 * r.bubble:.1f}%)")
    if isinstance(baseline, Candidate):
        state = (
            "fits" if baseline.fits else f"does not fit ({max(baseline.over, key=lambda k: baseline.over[k])} budget)"
        )
        lines.append(
            f"the fixed layout rule with the config's micro-batches, `{baseline.label()}`, predicts "
            f"{baseline.iteration:.4g} s and {state}: the winner is {speedup(best.iteration, baseline.iteration):.3g}x faster"
        )
    elif baseline:
        lines.append(f"the fixed layout rule cannot run this job: {baseline}")
    return lines


def _cand_dict(c: Candidate) -> dict[str, Any]:
    o = c.options
    return {
        "schedule": o.schedule,
        "stages_per_rank": o.stages_per_rank,
        "split": o.split,
        "cfg": o.cfg,
        "param_buffers": o.param_buffers,
        "optimizer_workers": o.optimizer_workers,
        "threads_per_worker": c.threads_per_worker,
        "micro_batch_size": c.micro_batch_size,
        "replicas": c.replicas,
        "micro_batches": c.micro_batches,
        "global_batch": c.global_batch,
        "iteration_s": c.iteration,
        "exposed_io_s": c.exposed_io,
        "bubble": c.bubble,
        "gpu_bytes": c.gpu,
        "gpu_parts": c.gpu_parts,
        "host_bytes": c.host,
        "shm_bytes": c.shm,
        "over": c.over,
        "fits": c.fits,
        "label": c.label(),
    }


def as_dict(result: Result, changes: list[Change], baseline: Candidate | str | None, top: int) -> dict[str, Any]:
    """Everything :func:`table` and :func:`why` print, as plain data."""
    closest = result.closest
    return {
        "global_batch": result.job.global_batch,
        "ranks": result.job.n_ranks,
        "seq_len": result.job.seq_len,
        "budget": {r: getattr(result.budget, r) for r in RESOURCES if getattr(result.budget, r) != math.inf},
        "top": [_cand_dict(c) for c in result.fitting[:top]],
        "n_fitting": len(result.fitting),
        "n_rejected": len(result.rejected),
        "n_invalid": len(result.invalid),
        "closest": _cand_dict(closest) if result.best is None and closest is not None else None,
        "changes": [{"kind": ch.kind, "value": ch.value, "text": ch.text} for ch in changes],
        "baseline": _cand_dict(baseline) if isinstance(baseline, Candidate) else baseline,
        "why": why(result, baseline),
    }
