"""Is the default job's learning rate stable? (issue 12, point 6)

A job trained at the edge of stability amplifies a rounding difference step after step, so the
same command gives different losses on another CPU (AVX2 vs AVX-512 kernels round differently).
This script measures that sensitivity without a second machine: it trains the default job twice
side by side (``schedule=single``, the path ``sysx-train`` takes), once from the seeded weights and
once with ONE weight moved by one ulp (``torch.nextafter``), and prints the largest difference of
the training loss over all steps and the first step where it passes ``--tolerance``.

Any override of ``sysx-train`` can be given, e.g. to compare learning rates::

    PYTHONPATH=. python profiling/check_lr_stability.py                      # the default job, 500 steps
    PYTHONPATH=. python profiling/check_lr_stability.py optim.lr=3e-3 optim.warmup_steps=30 --steps 100
"""

from __future__ import annotations

import argparse
import time

import torch

from sysx.config import load_config, model_config
from sysx.model import build_model
from sysx.trainers.single import SingleTrainer

# Always set: the plan print and eval do not change the training losses, they only cost time.
QUIET = ["schedule=single", "device=cpu", "eval.every=0", "single.print_plan=false", "log.progress=false"]


def nudged_model(cfg_overrides: list[str], layer: int, name: str, index: int) -> torch.nn.Module:
    """The seeded model with element ``index`` of parameter ``name`` of flat layer ``layer`` moved up by one ulp."""
    cfg = load_config(cfg_overrides)
    model = build_model(model_config(cfg), seed=cfg.seed)
    param = dict(model.layers[layer].named_parameters())[name]
    with torch.no_grad():
        flat = param.view(-1)
        flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf")))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="sysx-train overrides (key=value)")
    parser.add_argument("--steps", type=int, default=None, help="steps to compare (default: train.steps)")
    parser.add_argument("--layer", type=int, default=1, help="flat layer holding the nudged weight (1 = first Block)")
    parser.add_argument("--param", default="attn.q_proj.weight", help="parameter name inside that layer")
    parser.add_argument("--index", type=int, default=0, help="element of the flattened parameter")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="loss difference that counts as diverged")
    args = parser.parse_args()

    overrides = [*args.overrides, *QUIET]
    cfg = load_config(overrides)
    steps = args.steps or cfg.train.steps
    o = cfg.optim
    print(
        f"lr {o.lr} warmup {o.warmup_steps} min_lr {o.final_lr} | {steps} of {cfg.train.steps} steps | "
        f"nudge: layer {args.layer} {args.param}[{args.index}] by 1 ulp | threads {torch.get_num_threads()}",
        flush=True,
    )
    base = SingleTrainer(cfg)
    nudged = SingleTrainer(load_config(overrides), model=nudged_model(overrides, args.layer, args.param, args.index))
    worst, worst_step, first_over = 0.0, 0, None
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            a, b = base.train_step().loss, nudged.train_step().loss
            diff = abs(a - b)
            if diff > worst:
                worst, worst_step = diff, step
            if first_over is None and diff > args.tolerance:
                first_over = step
            if step % 50 == 0 or step == steps - 1:
                print(
                    f"step {step:4d} | loss {a:.6f} vs {b:.6f} | diff {diff:.2e} | max so far {worst:.2e}", flush=True
                )
    finally:
        base.close()
        nudged.close()
    verdict = "stable" if first_over is None else f"diverged at step {first_over}"
    print(
        f"max |loss difference| over {steps} steps: {worst:.2e} (step {worst_step}); "
        f"tolerance {args.tolerance:g}: {verdict} | {time.perf_counter() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
