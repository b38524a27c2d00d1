"""Where the single window's start-time pass timing stands against its run (issue 27, twenty-first session).

Runs ``sysx.train`` with one of these probes around :func:`sysx.single.pass_timing.measure_passes`:

- ``repeat``: at start, time the passes 6 times back to back and print each re-priced step;
- ``cold``: at start, time them 3 times after nothing, 0.3 s of 2-thread matmuls or 0.3 s of the
  passes themselves (``WARM=none|matmul|passes``); print the first against the next two's mean;
- ``span``: time them once with ``SPAN`` seconds a pass over ``ROUNDS`` rounds (the default: 0.1
  and 5) and print the re-priced step and the time it took;
- ``bracket``: at the check, time the passes again and print the check's error against the plan
  re-priced with the start's timing, with this one and with their mean.

    PYTHONPATH=. python profiling/results/cpu_2026-12-03_twentyfirst/pass_timing_probe.py PROBE OVERRIDES...
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

import sysx.single.pass_timing as pt
import sysx.trainers.prediction as pr
import sysx.trainers.single as st
from sysx.train import main as train_main

MEASURE = pt.measure_passes


def step_s(plan: Any, passes: pt.PassTimes | None) -> float:
    """The plan's step re-priced with ``passes``."""
    return float(pt.timed_plan(plan, passes).times["step_s"])


def repeat(plan: Any, device: torch.device, **kw: Any) -> pt.PassTimes | None:
    out = [step_s(plan, MEASURE(plan, device, **kw)) for _ in range(6)]
    print("PROBE repeat", " ".join(f"{s:.4f}" for s in out), flush=True)
    return MEASURE(plan, device, **kw)


def cold(plan: Any, device: torch.device, **kw: Any) -> pt.PassTimes | None:
    warm, until = os.environ.get("WARM", "none"), time.perf_counter() + 0.3
    if warm == "matmul":
        a = torch.randn(256, 256)
        while time.perf_counter() < until:
            a @ a
    elif warm == "passes":
        while time.perf_counter() < until:
            MEASURE(plan, device, rounds=1)
    out = [step_s(plan, MEASURE(plan, device, **kw)) for _ in range(3)]
    ratio = out[0] / (sum(out[1:]) / 2)
    print(f"PROBE cold {warm:7s}", " ".join(f"{s:.4f}" for s in out), f"ratio {ratio:.3f}", flush=True)
    return MEASURE(plan, device, **kw)


def span(plan: Any, device: torch.device, **kw: Any) -> pt.PassTimes | None:
    pt.SPAN_S = float(os.environ.get("SPAN", "0.1"))
    t0 = time.perf_counter()
    passes = MEASURE(plan, device, rounds=int(os.environ.get("ROUNDS", "5")))
    print(f"PROBE span {pt.SPAN_S} plan {step_s(plan, passes):.4f} took {time.perf_counter() - t0:.2f} s", flush=True)
    return passes


START: list[pt.PassTimes | None] = []


def keep_start(plan: Any, device: torch.device, **kw: Any) -> pt.PassTimes | None:
    START.append(MEASURE(plan, device, **kw))
    return START[-1]


AFTER_STEP = pr.SinglePrediction.after_step


def bracket(self: pr.SinglePrediction, result: Any, total_steps: int, recorded: Any) -> None:
    had = bool(self.section)
    AFTER_STEP(self, result, total_steps, recorded)
    if had or not self.section:
        return
    s, e = START[-1], MEASURE(self.plan, self.device)
    if s is None or e is None:
        return
    both = pt.PassTimes((s.forward_s + e.forward_s) / 2, (s.backward_s + e.backward_s) / 2, (s.head_s + e.head_s) / 2)
    measured = self.section["iteration_s"]["measured"]
    errors = [100 * (measured / step_s(self.plan, q) - 1) for q in (s, e, both)]
    print("PROBE bracket start {:+.1f}% end {:+.1f}% bracket {:+.1f}%".format(*errors), flush=True)


if __name__ == "__main__":
    probe, overrides = sys.argv[1], sys.argv[2:]
    if probe == "bracket":
        st.measure_passes = keep_start
        pr.SinglePrediction.after_step = bracket  # type: ignore[method-assign]
    else:
        st.measure_passes = {"repeat": repeat, "cold": cold, "span": span}[probe]
    sys.exit(train_main(overrides))
