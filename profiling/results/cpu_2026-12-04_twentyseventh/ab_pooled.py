"""The two pinning A/Bs pooled: pair ratios (pinned / not) of measured s/iteration, each arm's cv.

python profiling/results/cpu_2026-12-04_twentyseventh/ab_pooled.py
"""

import re
import statistics as st
from pathlib import Path

HERE = Path(__file__).parent
arms: dict[str, list[float]] = {"0": [], "1": []}
ratios = []
for name in ("ab_bind_after_tune.out", "ab_bind_cores.out"):
    runs = {}
    for line in (HERE / name).read_text().splitlines():
        m = re.match(r"b([01])\.(\w) .* meas ([\d.]+)", line)
        if m:
            runs[(m[1], m[2])] = float(m[3])
    for (arm, pair), measured in sorted(runs.items()):
        arms[arm].append(measured)
        if arm == "1" and ("0", pair) in runs:
            ratios.append(measured / runs[("0", pair)])
    print(name, "pairs:", " ".join(f"{r:.3f}" for r in ratios[-6:]))
for arm, label in (("0", "not pinned"), ("1", "pinned")):
    v = arms[arm]
    print(f"{label}: {len(v)} runs, median {st.median(v):.4f} s, cv {st.stdev(v) / st.mean(v):.3f}")
faster = sum(r < 1 for r in ratios)
print(f"pinned / not pinned: median {st.median(ratios):.3f} over {len(ratios)} pairs, {faster} faster")
