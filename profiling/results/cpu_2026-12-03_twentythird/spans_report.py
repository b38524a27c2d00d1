import collections
import json
import statistics as st
from pathlib import Path

R = [json.loads(Path(f"/tmp/p23/spans-{r}.json").read_text()) for r in (0, 1)]


def steps(spans):
    ts = sorted([s for s in spans if s[0] == "train_step"], key=lambda s: s[2])
    out = []
    for a in ts:
        inside = [s for s in spans if a[2] <= s[2] <= a[3]]
        out.append((a, inside))
    return out


S = [steps(r) for r in R]
rows = collections.defaultdict(list)
n = min(len(S[0]), len(S[1]))
for i in range(5, n):  # after warm-up
    per = {}
    for r in (0, 1):
        a, inside = S[r][i]
        d = {}
        for name, _th, t0, t1, extra in inside:
            d.setdefault(name if name != "collective" else "coll:" + extra[:28], []).append((t0, t1))
        per[r] = (a, d)
    bend = [per[r][1]["_backward"][-1][1] for r in (0, 1)]
    last = max(bend)
    first = min(bend)
    rows["spread B end"].append(last - first)
    for r in (0, 1):
        a, d = per[r]
        rows[f"r{r} step"].append(a[3] - a[2])
        rows[f"r{r} F"].append(sum(t1 - t0 for t0, t1 in d["_forward"]))
        rows[f"r{r} B"].append(sum(t1 - t0 for t0, t1 in d["_backward"]))
        rows[f"r{r} start->F"].append(d["_forward"][0][0] - a[2])
        rows[f"r{r} Bend->VAL start"].append(d["_validate"][0][0] - d["_backward"][-1][1])
        rows[f"r{r} VAL"].append(d["_validate"][0][1] - d["_validate"][0][0])
        rows[f"r{r} last Bend->VAL end"].append(d["_validate"][0][1] - last)
        rows[f"r{r} VAL end->step end"].append(a[3] - d["_validate"][0][1])
        for k in ("reduce", "opt_job", "threads.wait", "decide", "wait_stages", "end_step"):
            if k in d:
                rows[f"r{r} {k}"].append(sum(t1 - t0 for t0, t1 in d[k]))
                rows[f"r{r} last Bend->{k} start"].append(d[k][0][0] - last)
                rows[f"r{r} last Bend->{k} end"].append(d[k][-1][1] - last)
        for k, v in d.items():
            if k.startswith("coll:"):
                rows[f"r{r} {k} (n={len(v)})"].append(sum(t1 - t0 for t0, t1 in v))
    # gap to next step
for k, v in rows.items():
    print(f"{k:55s} median {st.median(v) * 1e3:7.2f} ms  mean {st.fmean(v) * 1e3:7.2f}")
# between steps
for r in (0, 1):
    ts = [a for a, _ in S[r]]
    gaps = [b[2] - a[3] for a, b in zip(ts[5:], ts[6:])]
    print(f"r{r} between train_step calls median {st.median(gaps) * 1e3:.2f} ms mean {st.fmean(gaps) * 1e3:.2f}")
