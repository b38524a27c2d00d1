"""Speed of the planners' inner loops (issue 12): the checks that used to be test asserts.

A test whose outcome depends on the machine's speed fails on a busy machine, so the speed targets
live here and the tests check only the results:

* ``simulate`` of a SysX schedule (4 ranks, 4 micro-batches, 8 stages, d=2), the autotuner's inner
  loop: target more than 1000 simulations/s (was ``tests/test_schedule_sim.py::test_simulate_is_fast``);
* the saved-activation DP for a real model size (80 transferring blocks, 5 options, 4 chunks per
  round): target under 5 s (was the time assert of ``tests/test_act_policy.py``).

Prints one line per check; exit code 1 when a target is missed::

    PYTHONPATH=. python profiling/bench_planners.py
"""

from __future__ import annotations

import sys
import time

from sysx.schedule import UnitCosts, build_sysx, simulate
from sysx.single.act_policy import SaveProblem, simulate_forward, solve_save_levels

SIMULATIONS_PER_S = 1000.0
DP_SECONDS = 5.0


def simulations_per_second(n: int = 200) -> float:
    """Simulations per second of the paper's Figure 8 setting (timeline and memory off)."""
    schedule = build_sysx(4, 4, n_stages=8, split=2)
    costs = UnitCosts(1, 2, 6)
    simulate(schedule, costs, record=False, memory=False)  # warm
    t0 = time.perf_counter()
    for _ in range(n):
        simulate(schedule, costs, record=False, memory=False)
    return n / (time.perf_counter() - t0)


def dp_seconds() -> float:
    """Seconds to solve the saved-activation DP for 80 transferring blocks (the solution must be feasible)."""
    n_tr, window, options, chunks = 80, 8, 5, 4
    problem = SaveProblem.make(
        [1.0] * (n_tr + window),
        [[0.12 * o for o in range(1, options + 1)]] * n_tr,
        [[float(o) for o in range(options)]] * n_tr,
        ring_slots=window * chunks,
        chunks=chunks,
        transfer_layers=n_tr,
        host_bytes=[[float(o + 1) for o in range(options)]] * n_tr,
        host_capacity=3.0 * n_tr * chunks,
    )
    t0 = time.perf_counter()
    solution = solve_save_levels(problem)
    seconds = time.perf_counter() - t0
    if not (solution.feasible and simulate_forward(problem, solution.levels)[0]):
        raise SystemExit("bench_planners: the DP found no feasible plan")
    return seconds


def main() -> int:
    rate, dp = simulations_per_second(), dp_seconds()
    ok_rate, ok_dp = rate > SIMULATIONS_PER_S, dp < DP_SECONDS
    print(f"simulate: {rate:.0f} simulations/s (target > {SIMULATIONS_PER_S:.0f}): {'ok' if ok_rate else 'SLOW'}")
    print(f"activation DP, 80 blocks: {dp:.2f} s (target < {DP_SECONDS:.0f} s): {'ok' if ok_dp else 'SLOW'}")
    return 0 if ok_rate and ok_dp else 1


if __name__ == "__main__":
    sys.exit(main())
