"""single:tiny's re-priced step at several pass-timing spans, interleaved, in one process (issue 27,
twenty-fourth session): the check's single:tiny configuration, its plan timed again with
``SPAN_S`` set to each span in turn, ``REPS`` times.

    SYSX_CACHE_DIR=$(mktemp -d) python span_probe.py 0.1,0.5,1.5 5
"""

import statistics
import sys
import time

import torch

import sysx.single.pass_timing as pt
from sysx.config.compose import load_config
from sysx.trainers.single import SingleTrainer

OVERRIDES = [
    "schedule=single",
    "model=tiny",
    "eval.every=0",
    "log.progress=false",
    "optim.backend=torch",
    "train.seq_len=128",
    "device=cpu",
    "train.steps=20",
    "run_dir=/tmp/span_probe_run",
    "single.print_plan=false",
]


def main(spans: list[float], reps: int) -> None:
    plan = SingleTrainer(load_config(OVERRIDES)).plan
    out: dict[float, list[float]] = {s: [] for s in spans}
    for r in range(reps):
        for s in spans:
            pt.SPAN_S = s
            t0 = time.perf_counter()
            passes = pt.measure_passes(plan, torch.device("cpu"))
            assert passes is not None
            step = pt.timed_plan(plan, passes).times["step_s"]
            out[s].append(step)
            print(
                f"rep {r} span {s}: step {step * 1e3:.1f} ms  fwd {passes.forward_s * 1e3:.2f} "
                f"bwd {passes.backward_s * 1e3:.2f} head {passes.head_s * 1e3:.2f}  ({time.perf_counter() - t0:.2f} s)",
                flush=True,
            )
    for s, v in out.items():
        m = statistics.mean(v)
        print(
            f"span {s}: mean {m * 1e3:.1f} ms  cv {statistics.pstdev(v) / m:.3f}  range {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f}"
        )


if __name__ == "__main__":
    main([float(s) for s in sys.argv[1].split(",")], int(sys.argv[2]))
