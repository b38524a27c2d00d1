"""How often a check of N rounds would pass, resampling the runs the check recorded (issue 27,
point 3, twenty-fourth session): per row, N runs drawn with replacement from its recorded runs,
their median time and host errors against the bounds (10%, 15%); the share of 20,000 draws in
which each row passes and in which every row does. Also each row's correlation between predicted
and measured seconds (does the plan track the machine's state?) and how many runs a constant
prediction of the row's pooled measured median would have put within 10% (the machine's side).

    python profiling/results/cpu_2026-12-03_twentyfourth/pass_chance.py A.jsonl B.jsonl ...
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path


def main(files: list[str]) -> None:
    runs: dict[str, list[tuple[float, float, float, float]]] = {}
    for path in files:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            pred = row.get("prediction") or {}
            if "iteration_s" not in pred:
                continue
            t, h = pred["iteration_s"], pred["peak_host_bytes"]
            runs.setdefault(row["name"], []).append((t["predicted"], t["measured"], t["error_pct"], h["error_pct"]))
    for name, v in runs.items():
        predicted, measured = [p for p, *_ in v], [m for _, m, *_ in v]
        mid = statistics.median(measured)
        oracle = sum(abs(m / mid - 1) <= 0.10 for m in measured)
        corr = statistics.correlation(predicted, measured)
        print(
            f"{name}: {len(v)} runs, corr(predicted, measured) {corr:+.2f}, constant oracle within 10%: {oracle}/{len(v)}"
        )
    rng = random.Random(0)
    draws = 20000
    for n in (1, 3, 5, 7):
        every, per = 0, dict.fromkeys(runs, 0)
        for _ in range(draws):
            ok = True
            for name, v in runs.items():
                sample = [rng.choice(v) for _ in range(n)]
                inside = (
                    abs(statistics.median(s[2] for s in sample)) <= 10
                    and abs(statistics.median(s[3] for s in sample)) <= 15
                )
                per[name] += inside
                ok &= inside
            every += ok
        shares = ", ".join(f"{k} {c / draws:.2f}" for k, c in per.items())
        print(f"{n} round(s): every row passes {every / draws:.2f}; per row: {shares}")


if __name__ == "__main__":
    main(sys.argv[1:])
