"""What each remaining idea would give SysX against Mobius on the emulated Fig. 9 grid (planner only).

Issue 27, point 1 asks for SysX >= 1.30x Mobius in every cell and >= 1.35x on average. This script
plans every cell (``bench_pipeline.py``'s configs, the emulated CostTable, with the posted receives
of :mod:`sysx.schedule.posted`) with Mobius at its default layout, and SysX at the layout these
levers were priced on, 4 forward stages per rank of d = 3 sub-stages (``LEVER_LAYOUT``; the
default until issue 27's twelfth session), with one cost changed each, running nothing; and SysX
at today's default beside them:

- ``a block per stage``: the runtime's default layout now (one Block per forward stage, d = 1, the
  backward ring going on from the last forward stage's rank, the last step spread over the node:
  :func:`sysx.runtime.options.block_stages`; the Head's input gradient computed by its forward for
  3/4 of the micro-batches, ``schedule.head_input_grad``; each backward in two parts of a sequence,
  ``schedule.backward_parts``), as ``bench_pipeline.py`` runs it. The Head levers below change that
  layout with no input gradient moved (``head_input_grad=0``);

- ``block, head free``: an upper bound for every Head lever at that layout (fused, cut, split by
  micro-batch over ranks): its Head's backward (the first backward sub-stage, on the rank that leads
  the backward ring) costing nothing. It gains a fraction of the Head's time: the leading rank then
  waits for the first backward round's wave instead (a micro-batch's hop around every other rank,
  about as long as the Head's backward of all micro-batches);
- ``block, head split``: the Head at that layout split by micro-batch between its two ranks, the
  share (``split share``, of ``n_micro``) that plans fastest: fused on its forward's rank (the loss
  backward right after the forward, no recompute: three Head forwards there) for that share, on
  the backward ring's leading rank for the rest. It prices the load only: the Head's gradients would
  come from two ranks and have to be summed before its step (both on one node, not built). At 16
  micro-batches it stays below 1.30x in the two worst cells, like the free Head; with every
  micro-batch a sequence (``--sysx-micro-batch 1``: each hop of the turn and the drain halved) it
  clears 1.30x in every cell;
- ``block, head input grad``: the Head's backward split the other way, with no gradient to sum:
  ``schedule.head_input_grad`` at the count (``grad share``) that plans fastest, the schedule the
  runtime runs (:func:`best_moved`): the input gradient computed on the Head's forward rank right
  after the forward and sent from there, the weight gradient left on the leading rank (recompute
  and weight gradient);

- ``s4d3``: SysX at ``LEVER_LAYOUT``, the last step on its owner (what every lever below changes);
- ``opt spread``: the optimizer step of sub-stage (0, 0) (Embedding + a block; the last step of the
  iteration) shared by the ranks of its owner's node (:func:`sysx.schedule.spread.spread_last_step`:
  each steps its share on its own worker, after its own steps and the owner's offload);
- ``head fused``: the Head's loss backward done by rank Ng-1 right after its forward (no recompute
  of the Head; the first backward sub-stage loses it);
- ``head fused, best share``: the Head fused for only some of the micro-batches, the share (``fused
  share``, of ``n_micro``) that plans fastest: rank Ng-1 starts its forwards last (the fill) and
  rank 0 ends its backwards first (the drain runs on from it), so all the Head on either one is the
  step's critical path, and a split between them may be shorter than both;
- ``head cut``: an upper bound for cutting the Head (sub-stages of their own, or the vocabulary
  projection in pieces): its forward and backward shared evenly by every stage and sub-stage, as if
  a cut cost nothing and balanced perfectly;
- ``head cut + opt spread``: both at once (the two bounds together);
- ``head cut + opt spread + drain halved``: an estimate on top of the two bounds: the drain (from
  the first rank's last backward to the last rank's, one micro-batch's hop a rank through the last
  backward round) taken half off the planned iteration, as if the last round ran in half
  micro-batches (one sequence each, half the hop); the one combination found that clears 1.30x in
  every cell;
- ``no recompute, last round``: an upper bound: the last forward round's sub-stages backpropagate
  without recomputing, as if their activations reached the backward's rank for free (they do not:
  the ``link/recompute`` column is a block's activations over the link against its recompute);
- ``no recompute, 1st bwd round``: the same for the first backward round only (one sub-stage a
  rank, the one whose forward ran last), the smallest kept set; ``held GiB`` is what holding those
  activations on the backward's rank from their forward's end to their backward's end takes at its
  peak (the busiest rank, from the plan's timeline), ``free GiB`` the least the GPU has beside the
  plan's own peak on any rank. Where held > free the kept set does not fit, even before asking how
  another process would backpropagate a graph its forward's process built (it cannot: an autograd
  graph lives in one process, so a backward elsewhere recomputes or needs a hand-written one);
- ``ceiling``: Mobius over SysX's busiest rank's busy time (no idle time at all).

    PYTHONPATH=. .venv/bin/python profiling/long_seq_levers.py
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sysx.emulate.costs import emulated_model, plan_emulation
from sysx.runtime.options import make_schedule
from sysx.schedule.costs import CostTable, model_layer_act_bytes
from sysx.schedule.ops import OpKind, Schedule
from sysx.schedule.simulate import simulate
from sysx.schedule.spread import spread_over_node

_SPEC = importlib.util.spec_from_file_location("bench_pipeline", Path(__file__).with_name("bench_pipeline.py"))
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

ARGS: dict[str, Any] = {"steps": 4, "warmup": 1, "time_scale": 0.5, "optimizer_workers": 1, "gpu": "v100"}
LEVER_LAYOUT = "@s4d3"  # the layout the levers below change one cost of
LEVERS = (
    "a block per stage",
    "block, head free",
    "block, head split",
    "block, head input grad",
    "s4d3",
    "opt spread",
    "head fused",
    "head fused, best share",
    "head cut",
    "head cut + opt spread",
    "head cut + opt spread + drain halved",
    "no recompute, last round",
    "no recompute, 1st bwd round",
    "ceiling",
)
GIB = 2**30


def _cell(
    model: str, seq: int, schedule: str, micro_batch: int | None = None, head_input_grad: int | None = None
) -> tuple[Schedule, Any]:
    """The schedule ``bench_pipeline.py`` runs for one cell, and its job config."""
    name, n_ranks = bench.MODELS[model]
    overrides = None
    if micro_batch is not None and micro_batch != bench.MICRO_BATCH:
        nodes = max(1, n_ranks // bench.GPUS_PER_NODE)
        overrides = {
            "emulate.micro_batch_size": micro_batch,
            "train.micro_batch_size": micro_batch,  # the rows schedule.backward_parts may split
            "train.micro_batches": bench.BATCH_PER_NODE * nodes // micro_batch,
        }
    cfg, opts = bench._cell_config(name, seq, n_ranks, schedule, ARGS, overrides=overrides)
    if head_input_grad is not None:
        opts = dataclasses.replace(opts, head_input_grad=head_input_grad)
    em = emulated_model(cfg)
    sched = make_schedule(
        opts,
        em.config,
        n_ranks=n_ranks,
        n_micro=cfg.train.micro_batches,
        seq_len=em.seq_len,
        ranks_per_node=bench.GPUS_PER_NODE,
        micro_batch_size=cfg.train.micro_batch_size,
    )
    return sched, cfg


def plan(
    model: str, seq: int, schedule: str, micro_batch: int | None = None, head_input_grad: int | None = None
) -> tuple[Schedule, Any]:
    """The schedule and emulated plan ``bench_pipeline.py`` runs for one cell; ``micro_batch``:
    sequences per micro-batch (None: the Fig. 9 setting's), the node's batch kept;
    ``head_input_grad``: ``schedule.head_input_grad`` (None: the default's)."""
    sched, cfg = _cell(model, seq, schedule, micro_batch, head_input_grad)
    return sched, plan_emulation(cfg, sched, backend="torch")


def best_moved(model: str, seq: int, table: CostTable, micro_batch: int | None = None) -> tuple[int, float]:
    """``(k, iteration)``: the ``schedule.head_input_grad`` (of ``n_micro``) whose schedule plans the
    shortest iteration under ``table`` (a plan of the cell's SysX), and that iteration."""
    n = _cell(model, seq, "sysx:cfg3", micro_batch, 0)[0].n_micro
    runs = ((k, iteration(_cell(model, seq, "sysx:cfg3", micro_batch, k)[0], table)) for k in range(n + 1))
    return min(runs, key=lambda kv: kv[1])


def iteration(sched: Schedule, table: CostTable) -> float:
    """The planned iteration (modelled seconds)."""
    return simulate(sched, table, record=False, memory=False, gpus_per_node=bench.GPUS_PER_NODE).iteration


def spread(sched: Schedule) -> Schedule:
    """``sched`` with its last optimizer step shared by the ranks of its owner's node."""
    return spread_over_node(sched, bench.GPUS_PER_NODE)


def _head_fused(t: CostTable, share: float = 1.0) -> CostTable:
    """The Head's loss backward on rank Ng-1 right after its forward for ``share`` of the
    micro-batches (its two forwards' worth there; its recompute and backward, three, leave the first
    backward sub-stage). The table prices every micro-batch alike, so a share is spread evenly over
    them: the same work, smoother than fusing whole micro-batches would be."""
    head = t.fwd[-1] - t.fwd[-2]  # the last stage's forward less a plain stage's: the Head's
    return dataclasses.replace(
        t, fwd=[*t.fwd[:-1], t.fwd[-1] + 2 * head * share], bwd=[*t.bwd[:-1], t.bwd[-1] - 3 * head * share]
    )


def best_share(sched: Schedule, table: CostTable, change: Callable[[CostTable, float], CostTable]) -> tuple[int, float]:
    """``(k, iteration)``: the number of micro-batches (of ``n_micro``) that ``change`` (a table and a
    share of the micro-batches) applied to plans the shortest iteration, and that iteration (k = 0 is
    the schedule unchanged)."""
    n = sched.n_micro
    return min(((k, iteration(sched, change(table, k / n))) for k in range(n + 1)), key=lambda kv: kv[1])


def _head_cut(t: CostTable) -> CostTable:
    def even(costs: list[float]) -> list[float]:
        head = costs[-1] - costs[-2]  # the last (sub-)stage less a plain one: the Head's share
        return [c + head / len(costs) - (head if i == len(costs) - 1 else 0.0) for i, c in enumerate(costs)]

    return dataclasses.replace(t, fwd=even(t.fwd), bwd=even(t.bwd))


def _head_free(t: CostTable) -> CostTable:
    """The Head's backward at no cost, where the Head is a stage of its own (the last)."""
    return dataclasses.replace(t, bwd=[*t.bwd[:-1], 0.0])


def _head_split(t: CostTable, share: float) -> CostTable:
    """The Head (a stage of its own, the last) fused on its forward's rank for ``share`` of the
    micro-batches: a forward and a backward without recompute (three forwards) there, its backward
    sub-stage (recompute and backward) losing that share. Spread evenly over the micro-batches, as
    :func:`_head_fused` is."""
    return dataclasses.replace(
        t, fwd=[*t.fwd[:-1], t.fwd[-1] * (1 + 2 * share)], bwd=[*t.bwd[:-1], t.bwd[-1] * (1 - share)]
    )


def drain(sched: Schedule, table: CostTable) -> tuple[float, float]:
    """``(iteration, drain)`` planned: the drain is the time from the first rank's last backward
    pass to the last rank's (the last micro-batch crossing the last backward round)."""
    tl = simulate(sched, table, record=True, memory=False, gpus_per_node=bench.GPUS_PER_NODE)
    ends = [0.0] * sched.n_ranks
    for e in tl.events:
        if e.op.kind == OpKind.BACKWARD:
            ends[e.rank] = max(ends[e.rank], e.end)
    return tl.iteration, max(ends) - min(ends)


def _first_kept(sched: Schedule, rounds: int) -> int:
    """The lowest sub-stage index (``stage * split + sub``) in the first ``rounds`` backward rounds:
    the ring backpropagates sub-stages from the last down, one a rank per round."""
    return sched.n_stages * sched.split - rounds * sched.n_ranks


def _kept(sched: Schedule, rounds: int) -> Callable[[CostTable], CostTable]:
    """The first ``rounds`` backward rounds' sub-stages (``rounds = split``: the last forward round's)
    backpropagate without recomputing: their backward costs 2 forwards instead of 3."""
    first = _first_kept(sched, rounds)

    def change(t: CostTable) -> CostTable:
        return dataclasses.replace(t, bwd=[b * 2 / 3 if i >= first else b for i, b in enumerate(t.bwd)])

    return change


def held_bytes(sched: Schedule, table: CostTable, act_bytes: float, rounds: int) -> list[float]:
    """Per rank, the peak bytes of kept activations if the first ``rounds`` backward rounds' sub-stages
    kept theirs on the backward's rank from their forward's end to their backward's end (the plan's
    timeline as it is now; ``act_bytes`` a one-block sub-stage's activations per micro-batch)."""
    tl = simulate(sched, table, record=True, memory=False, gpus_per_node=bench.GPUS_PER_NODE)
    fwd_end = {(e.op.stage, e.op.mb): e.end for e in tl.events if e.op.kind == OpKind.FORWARD}
    first = _first_kept(sched, rounds)
    deltas: list[list[tuple[float, float]]] = [[] for _ in range(sched.n_ranks)]
    for e in tl.events:
        op = e.op
        if op.kind == OpKind.BACKWARD and op.stage * sched.split + op.sub >= first:
            deltas[e.rank] += [(fwd_end[(op.stage, op.mb)], act_bytes), (e.end, -act_bytes)]
    peaks = []
    for d in deltas:
        held = peak = 0.0
        for _, b in sorted(d):  # at a tie the release (negative) sorts first
            held += b
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def cell(model: str, seq: int, sysx_micro_batch: int | None = None) -> dict[str, Any]:
    """One cell: SysX over Mobius under every lever, and the link-vs-recompute figure;
    ``sysx_micro_batch``: SysX's sequences per micro-batch (Mobius keeps the Fig. 9 setting's)."""
    msched, mplan = plan(model, seq, "mobius")
    # the levers add the spread themselves
    sched, splan = plan(model, seq, f"sysx:cfg3{LEVER_LAYOUT}~plain", sysx_micro_batch)
    default, dplan = plan(model, seq, "sysx:cfg3", sysx_micro_batch)
    # the Head levers change the block layout with no input gradient moved
    kept, kplan = plan(model, seq, "sysx:cfg3", sysx_micro_batch, head_input_grad=0)
    mob, t = iteration(msched, mplan.table), splan.table
    share, fused_best = best_share(sched, t, _head_fused)
    split_share, split_best = best_share(kept, kplan.table, _head_split)
    grad_share, grad_best = best_moved(model, seq, kplan.table, sysx_micro_batch)
    spread_sched = spread(sched)
    both, both_drain = drain(spread_sched, _head_cut(t))
    ratios = {
        "a block per stage": mob / iteration(default, dplan.table),
        "block, head free": mob / iteration(kept, _head_free(kplan.table)),
        "block, head split": mob / split_best,
        "block, head input grad": mob / grad_best,
        "s4d3": mob / iteration(sched, t),
        "opt spread": mob / iteration(spread_sched, t),
        "head fused": mob / iteration(sched, _head_fused(t)),
        "head fused, best share": mob / fused_best,
        "head cut": mob / iteration(sched, _head_cut(t)),
        "head cut + opt spread": mob / both,
        "head cut + opt spread + drain halved": mob / (both - both_drain / 2),
        "no recompute, last round": mob / iteration(sched, _kept(sched, sched.split)(t)),
        "no recompute, 1st bwd round": mob / iteration(sched, _kept(sched, 1)(t)),
        "ceiling": mob / max(splan.timeline.busy),
    }
    block_fwd = t.bwd[t.split + 1] / 3  # a one-block sub-stage's backward is 3 forwards (recompute + 2)
    act = model_layer_act_bytes(splan.model.config, seq * (sysx_micro_batch or bench.MICRO_BATCH))[1]
    link = act / splan.cluster.intra_bandwidth
    free = splan.cluster.gpu_memory_bytes - max(splan.timeline.peak_gpu)
    return {
        "model": model,
        "seq": seq,
        "ratios": ratios,
        "link_over_recompute": link / block_fwd,
        "fused_share": f"{share}/{sched.n_micro}",
        "split_share": f"{split_share}/{kept.n_micro}",
        "grad_share": f"{grad_share}/{default.n_micro}",
        "held_gib": max(held_bytes(sched, t, act, 1)) / GIB,
        "free_gib": free / GIB,
    }


def table(cells: list[dict[str, Any]]) -> str:
    """The markdown table, with the average and the worst cell of every lever."""
    head = (
        "| model | seq | "
        + " | ".join(LEVERS)
        + " | split share | grad share | fused share | link/recompute | held GiB | free GiB |"
    )
    rows = [head, "|---" * (len(LEVERS) + 8) + "|"]
    for c in cells:
        rs = " | ".join(f"{c['ratios'][k]:.3f}" for k in LEVERS)
        mem = f"{c['held_gib']:.1f} | {c['free_gib']:.1f}"
        rows.append(
            f"| {c['model'].upper()} | {c['seq']} | {rs} | {c['split_share']} | {c['grad_share']} | {c['fused_share']} | {c['link_over_recompute']:.2f} | {mem} |"
        )
    for name, f in (("average", statistics.mean), ("worst", min)):
        rs = " | ".join(f"{f(c['ratios'][k] for c in cells):.3f}" for k in LEVERS)
        rows.append(f"| {name} | | {rs} | | | | | | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="10b,19b,30b,40b", help="comma list of 10b, 19b, 30b, 40b")
    p.add_argument("--seq", default="2048,4096", help="comma list of sequence lengths")
    p.add_argument(
        "--sysx-micro-batch",
        type=int,
        default=None,
        help="SysX's sequences per micro-batch, the node's batch kept (Mobius keeps the Fig. 9 setting's 2); "
        "1 runs every round in half micro-batches, a check of the drain-halved estimate",
    )
    a = p.parse_args(argv)
    cells = [cell(m, int(s), a.sysx_micro_batch) for m in a.models.split(",") for s in a.seq.split(",")]
    print(table(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
