"""Is the machine slower after a 50M check row? (issue 27, twenty-fourth session): a fixed workload
(the tiny model's Block forward on 16 x 128 tokens, torch's threads) in 0.5-s windows before a
50M:2 row of the check and for 25 s after it, with /proc/meminfo's Dirty and Writeback (a
checkpoint's pages the kernel may still be writing).

    PYTHONPATH=. python profiling/results/cpu_2026-12-03_twentyfourth/after_probe.py
"""

import sys
import time
from pathlib import Path

import torch

from sysx.machine.hardware import mean_run_seconds
from sysx.model import get_preset
from sysx.model.llama import init_layer, make_layer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import check_predictions as check

CFG = get_preset("tiny")
BLOCK = make_layer(CFG, 1)
init_layer(BLOCK, 1)
X = torch.randn(16, 128, CFG.dim)


def reference_ms() -> float:
    with torch.no_grad():
        return 1e3 * mean_run_seconds(lambda: BLOCK(X), repeats=3, window_s=0.5)[0]


def dirty_writeback_mib() -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(fields["Dirty"].split()[0]) // 1024, int(fields["Writeback"].split()[0]) // 1024


def main() -> None:
    print("before:", [round(reference_ms(), 2) for _ in range(4)], dirty_writeback_mib(), flush=True)
    row = check.run_one("50M:2", "50M", 2, Path("/tmp/after_probe_run"), 900, Path("/tmp/after_probe_cache"))
    print("run:", row.get("prediction", {}).get("iteration_s"), flush=True)
    t0 = time.time()
    while time.time() - t0 < 25:
        ms = reference_ms()
        print(f"+{time.time() - t0:5.1f}s ref {ms:.2f} ms dirty/writeback MiB {dirty_writeback_mib()}", flush=True)


if __name__ == "__main__":
    main()
