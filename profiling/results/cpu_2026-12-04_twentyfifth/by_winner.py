"""Time errors of the check's tuned runs grouped by the layout the tuner picked (issue 27, twenty-fifth
session): does a layout run long whatever the machine did?

    python profiling/results/cpu_2026-12-04_twentyfifth/by_winner.py A.jsonl B.jsonl ...
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

KEYS = ("parallel.replicas", "stages_per_rank", "split", "micro_batch_size", "micro_batches", "optim.workers")


def layout(choice: list[str]) -> str:
    """The winner's layout as ``key=value`` words, the keys of :data:`KEYS` only."""
    line = next((c for c in choice if c.startswith("winner ")), "")
    words = dict(re.findall(r"([\w.]+)=(\S+?)[` ]", line + " "))
    return " ".join(f"{k.split('.')[-1]}={words[k]}" for k in KEYS if k in words)


def main(paths: list[str]) -> None:
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            if row.get("rc") != 0 or not row.get("choice"):
                continue
            groups[(row["name"], layout(row["choice"]))].append(row["prediction"]["iteration_s"]["error_pct"])
    print("| run | winner | runs | time error median | range |")
    print("|---|---|---:|---:|---|")
    for (name, win), errs in sorted(groups.items()):
        print(
            f"| {name} | {win} | {len(errs)} | {statistics.median(errs):+.1f}% | {min(errs):+.1f} .. {max(errs):+.1f}% |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
