"""What each remaining idea would give SysX against Mobius on the emulated Fig. 9 grid (planner only).

Issue 27, point 1 asks for SysX >= 1.30x Mobius in every cell and >= 1.35x on average. This script
plans every cell at the runtime's default layouts (``bench_pipeline.py``'s configs, the emulated
CostTable, with the posted receives of :mod:`sysx.schedule.posted`) and then SysX's with one cost
changed each, running nothing:

- ``opt spread``: the optimizer step of sub-stage (0, 0) (Embedding + a block; the last step of the
  iteration) spread over the node's ``gpus_per_node`` ranks' threads;
- ``head fused``: the Head's loss backward done by rank Ng-1 right after its forward (no recompute
  of the Head; the first backward sub-stage loses it);
- ``head cut``: an upper bound for cutting the Head (sub-stages of their own, or the vocabulary
  projection in pieces): its forward and backward shared evenly by every stage and sub-stage, as if
  a cut cost nothing and balanced perfectly;
- ``head cut + opt spread``: both at once (the two bounds together);
- ``no recompute, last round``: an upper bound: the last forward round's sub-stages backpropagate
  without recomputing, as if their activations reached the backward's rank for free (they do not:
  the ``link/recompute`` column is a block's activations over the link against its recompute);
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
from sysx.schedule.ops import Schedule
from sysx.schedule.simulate import simulate

_SPEC = importlib.util.spec_from_file_location("bench_pipeline", Path(__file__).with_name("bench_pipeline.py"))
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

ARGS: dict[str, Any] = {"steps": 4, "warmup": 1, "time_scale": 0.5, "optimizer_workers": 1, "gpu": "v100"}
LEVERS = ("now", "opt spread", "head fused", "head cut", "head cut + opt spread", "no recompute, last round", "ceiling")


def plan(model: str, seq: int, schedule: str) -> tuple[Schedule, Any]:
    """The schedule and emulated plan ``bench_pipeline.py`` runs for one cell."""
    name, n_ranks = bench.MODELS[model]
    cfg, opts = bench._cell_config(name, seq, n_ranks, schedule, ARGS)
    em = emulated_model(cfg)
    sched = make_schedule(opts, em.config, n_ranks=n_ranks, n_micro=cfg.train.micro_batches, seq_len=em.seq_len)
    return sched, plan_emulation(cfg, sched, backend="torch")


def iteration(sched: Schedule, table: CostTable) -> float:
    """The planned iteration (modelled seconds)."""
    return simulate(sched, table, record=False, memory=False, gpus_per_node=bench.GPUS_PER_NODE).iteration


def _spread(t: CostTable) -> CostTable:
    return dataclasses.replace(t, opt=[t.opt[0] / bench.GPUS_PER_NODE, *t.opt[1:]])


def _head_fused(t: CostTable) -> CostTable:
    head = t.fwd[-1] - t.fwd[-2]  # the last stage's forward less a plain stage's: the Head's
    return dataclasses.replace(t, fwd=[*t.fwd[:-1], t.fwd[-1] + 2 * head], bwd=[*t.bwd[:-1], t.bwd[-1] - 3 * head])


def _head_cut(t: CostTable) -> CostTable:
    def even(costs: list[float]) -> list[float]:
        head = costs[-1] - costs[-2]  # the last (sub-)stage less a plain one: the Head's share
        return [c + head / len(costs) - (head if i == len(costs) - 1 else 0.0) for i, c in enumerate(costs)]

    return dataclasses.replace(t, fwd=even(t.fwd), bwd=even(t.bwd))


def _last_round_kept(sched: Schedule) -> Callable[[CostTable], CostTable]:
    first = (sched.n_stages - sched.n_ranks) * sched.split  # the last forward round's first sub-stage

    def change(t: CostTable) -> CostTable:
        return dataclasses.replace(t, bwd=[b * 2 / 3 if i >= first else b for i, b in enumerate(t.bwd)])

    return change


def cell(model: str, seq: int) -> dict[str, Any]:
    """One cell: SysX over Mobius under every lever, and the link-vs-recompute figure."""
    msched, mplan = plan(model, seq, "mobius")
    sched, splan = plan(model, seq, "sysx:cfg3")
    mob, t = iteration(msched, mplan.table), splan.table
    ratios = {
        "now": mob / iteration(sched, t),
        "opt spread": mob / iteration(sched, _spread(t)),
        "head fused": mob / iteration(sched, _head_fused(t)),
        "head cut": mob / iteration(sched, _head_cut(t)),
        "head cut + opt spread": mob / iteration(sched, _spread(_head_cut(t))),
        "no recompute, last round": mob / iteration(sched, _last_round_kept(sched)(t)),
        "ceiling": mob / max(splan.timeline.busy),
    }
    block_fwd = t.bwd[t.split + 1] / 3  # a one-block sub-stage's backward is 3 forwards (recompute + 2)
    link = model_layer_act_bytes(splan.model.config, seq * bench.MICRO_BATCH)[1] / splan.cluster.intra_bandwidth
    return {"model": model, "seq": seq, "ratios": ratios, "link_over_recompute": link / block_fwd}


def table(cells: list[dict[str, Any]]) -> str:
    """The markdown table, with the average and the worst cell of every lever."""
    rows = ["| model | seq | " + " | ".join(LEVERS) + " | link/recompute |", "|---" * (len(LEVERS) + 3) + "|"]
    for c in cells:
        rs = " | ".join(f"{c['ratios'][k]:.3f}" for k in LEVERS)
        rows.append(f"| {c['model'].upper()} | {c['seq']} | {rs} | {c['link_over_recompute']:.2f} |")
    for name, f in (("average", statistics.mean), ("worst", min)):
        rs = " | ".join(f"{f(c['ratios'][k] for c in cells):.3f}" for k in LEVERS)
        rows.append(f"| {name} | | {rs} | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="10b,19b,30b,40b", help="comma list of 10b, 19b, 30b, 40b")
    p.add_argument("--seq", default="2048,4096", help="comma list of sequence lengths")
    a = p.parse_args(argv)
    cells = [cell(m, int(s)) for m in a.models.split(",") for s in a.seq.split(",")]
    print(table(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
