#!/bin/bash
# A = HEAD before the change, checked out with `git worktree add /tmp/p23/wt_head 4e440d6`; the profile cache /tmp/p23/cache1 from a tuned tiny:2 run.
# A/B, interleaved: the step end's serial chain (from the later replica's last backward to the end of
# end_step) and its collectives, timed by /work/main/profiling/results/cpu_2026-12-03_twentythird/site/sitecustomize.py; HEAD (A) vs the working tree (B).
export SYSX_CACHE_DIR=/tmp/p23/cache1 OMP_NUM_THREADS=1
for i in $(seq 1 ${1:-3}); do
  for v in A B; do
    T=/work/main; [ $v = A ] && T=/tmp/p23/wt_head
    rm -f /tmp/p23/spans-*.json; rm -rf /tmp/p23/r7
    (cd $T && SYSX_SPANS=1 PYTHONPATH=.:/work/main/profiling/results/cpu_2026-12-03_twentythird/site /work/main/.venv/bin/python -m sysx.launch --standalone --nproc_per_node=2 -m sysx.train schedule=sysx parallel.replicas=2 schedule.stages_per_rank=1 schedule.split=1 schedule.cfg=3 train.micro_batch_size=8 train.micro_batches=1 schedule.param_buffers=1 optim.workers=1 model=tiny eval.every=0 log.progress=false optim.backend=torch checkpoint.keep=1 train.seq_len=128 device=cpu train.steps=60 run_dir=/tmp/p23/r7 > /tmp/p23/r7.log 2>&1)
    python3 - $v $i <<'PY'
import json, statistics as st, sys
R = [json.load(open(f"/tmp/p23/spans-{r}.json")) for r in (0, 1)]
def per_step(sp):
    steps = sorted([s for s in sp if s[0] == "train_step"], key=lambda s: s[2])
    return [[s for s in sp if a[2] <= s[2] <= a[3]] + [a] for a in steps]
S = [per_step(r) for r in R]
chain, step, colls = [], [], {"grad": [], "VALI": [], "end ": []}
for i in range(10, min(len(S[0]), len(S[1]))):
    last = max(max(s[3] for s in S[r][i] if s[0] == "_backward") for r in (0, 1))
    for r in (0, 1):
        end = [s for s in S[r][i] if s[0] == "end_step"][0][3]
        chain.append(end - last)
        step.append(S[r][i][-1][3] - S[r][i][-1][2])
        for s in S[r][i]:
            if s[0] == "collective":
                k = s[4][:4] if not s[4].startswith("end of") else "end "
                colls.setdefault(k, []).append(s[3] - s[2])
print(sys.argv[1], sys.argv[2], "step %.1f ms, chain after the last backward %.2f ms; collectives (median ms): %s" % (
    st.median(step) * 1e3, st.median(chain) * 1e3, ", ".join(f"{k.strip()} {st.median(v)*1e3:.2f}" for k, v in colls.items() if v)), flush=True)
PY
  done
done
