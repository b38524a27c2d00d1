"""Per-step medians of the spans the twenty-third session's probe wrote (``/tmp/p23/spans-<rank>.json``),
steps 10 on, both ranks: the passes, VALIDATE, the step end, the reducer's and optimizer threads'
work, the collectives on the main thread and on the others, and the time from the later rank's last
backward to the end of ``end_step``."""

import collections
import json
import statistics
import sys
from pathlib import Path

RANKS = [json.loads(Path(f"/tmp/p23/spans-{r}.json").read_text()) for r in (0, 1)]


def per_step(spans: list) -> list:
    steps = sorted([s for s in spans if s[0] == "train_step"], key=lambda s: s[2])
    return [([s for s in spans if a[2] <= s[2] <= a[3]], a) for a in steps]


def main(label: str) -> None:
    steps = [per_step(r) for r in RANKS]
    agg: dict[str, list[float]] = collections.defaultdict(list)
    for i in range(10, min(len(steps[0]), len(steps[1]))):
        last = max(max(s[3] for s in steps[r][i][0] if s[0] == "_backward") for r in (0, 1))
        for r in (0, 1):
            inside, a = steps[r][i]
            agg["step"].append(a[3] - a[2])
            for name in ("_forward", "_backward", "_validate", "end_step", "decide", "wait_stages", "threads.wait"):
                agg[name].append(sum(s[3] - s[2] for s in inside if s[0] == name))
            agg["reduce(thread)"].append(sum(s[3] - s[2] for s in inside if s[0] == "reduce"))
            agg["opt_job(thread)"].append(sum(s[3] - s[2] for s in inside if s[0] == "opt_job"))
            agg["n_coll"].append(sum(1 for s in inside if s[0] == "collective"))
            agg["coll main"].append(sum(s[3] - s[2] for s in inside if s[0] == "collective" and s[1] == a[1]))
            agg["coll other"].append(sum(s[3] - s[2] for s in inside if s[0] == "collective" and s[1] != a[1]))
            agg["after last bwd"].append(next(s for s in inside if s[0] == "end_step")[3] - last)
            agg["first fwd start"].append(min(s[2] for s in inside if s[0] == "_forward") - a[2])
    cells = [
        f"{k} {statistics.median(v):.0f}" if k == "n_coll" else f"{k} {statistics.median(v) * 1e3:.2f}"
        for k, v in agg.items()
    ]
    print(label, " | ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
