"""tiny:2's tuned runs by the stages a rank their tuner picked, over the check's JSONL files of
2026-12-03 and the twenty-fifth session (issue 27, twenty-sixth session):

    python profiling/results/cpu_2026-12-04_twentysixth/stages_pooled.py
"""

from __future__ import annotations

import glob
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

FILES = sorted(glob.glob("profiling/results/check_predictions_2026-12-03_*.jsonl"))
FILES += ["profiling/results/check_predictions_2026-12-04_twentyfifth.jsonl"]
FILES += sorted(glob.glob("profiling/results/cpu_2026-12-03_twentyfourth/meeting_*.jsonl"))

groups: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
for path in FILES:
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row.get("name") != "tiny:2" or row.get("rc") != 0 or not row.get("choice"):
            continue
        winner = next((c for c in row["choice"] if c.startswith("winner")), "")
        stages = re.search(r"stages_per_rank=(\S+)", winner)
        it = row["prediction"]["iteration_s"]
        groups[stages.group(1) if stages else "?"].append((it["predicted"], it["measured"], it["error_pct"]))
print(f"{len(FILES)} files")
print("| stages a rank | runs | predicted median | measured median | error median |")
print("|---|---:|---:|---:|---:|")
for stages, rows in sorted(groups.items()):
    pred, meas, err = (statistics.median(x[i] for x in rows) for i in range(3))
    print(f"| {stages} | {len(rows)} | {pred:.4f} s | {meas:.4f} s | {err:+.1f}% |")
