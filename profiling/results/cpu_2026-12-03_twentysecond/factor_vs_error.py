"""How the pipeline rows' time error moves with the tuner's together-measured slowdown (issue 27, point 3).

Reads ``check_predictions.py --jsonl`` files and prints, per configuration with ranks, the
correlation of the "layers N.NNx the profile's with every rank computing" factor (from each run's
``schedule.tune`` line) with the run's time error and with its measured step time, and the
coefficient of variation of the predicted and of the measured step time over the runs.

    python profiling/results/cpu_2026-12-03_twentysecond/factor_vs_error.py FILE.jsonl [FILE.jsonl ...]
"""

from __future__ import annotations

import collections
import json
import re
import statistics
import sys


def main(paths: list[str]) -> None:
    runs: dict[str, list[tuple[float, float, float, float]]] = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                pred = (row.get("prediction") or {}).get("iteration_s")
                found = re.search(r"layers ([\d.]+)x", " ".join(row.get("choice") or []))
                if row["ranks"] > 1 and pred and found:
                    runs[row["name"]].append(
                        (float(found.group(1)), pred["error_pct"], pred["predicted"], pred["measured"])
                    )
    print("| run | runs | factor range | corr(factor, error) | corr(factor, measured) | cv predicted | cv measured |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, rows in runs.items():
        factor, error, predicted, measured = (list(col) for col in zip(*rows))
        cv = [statistics.pstdev(x) / statistics.fmean(x) for x in (predicted, measured)]
        print(
            f"| {name} | {len(rows)} | {min(factor):.2f}-{max(factor):.2f} "
            f"| {statistics.correlation(factor, error):+.2f} | {statistics.correlation(factor, measured):+.2f} "
            f"| {cv[0]:.3f} | {cv[1]:.3f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
