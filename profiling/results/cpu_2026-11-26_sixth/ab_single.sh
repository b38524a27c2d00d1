#!/bin/bash
# A/B of a schedule=single job at save level 0 (single.policy=input): median step time of steps 2..N.
# Run from the repository root; old code via `git stash push sysx/single/act_capture.py`, as in RESULTS.md.
# usage: ab_single.sh label model_overrides... ; prints median step time of steps 2..N
cd "$(git rev-parse --show-toplevel)"
shift  # the label is for the caller's log
rd=$(mktemp -d)/run
PYTHONPATH=. OMP_NUM_THREADS=1 timeout 600 .venv/bin/python -m sysx.train schedule=single single.policy=input eval.every=0 log.progress=false optim.backend=torch checkpoint.keep=1 train.seq_len=128 device=cpu run_dir=$rd "$@" > $rd.log 2>&1
python3 - $rd <<'PY'
import json,sys,statistics
rows=[json.loads(l) for l in open(sys.argv[1]+'/metrics.jsonl') if '"step"' in l]
ts=[r.get('step_time_s') or r.get('time_s') for r in rows[2:]]
ts=[t for t in ts if t]
pred=json.load(open(sys.argv[1]+'/summary.json')).get('prediction',{}).get('iteration_s',{})
print('median step %.4f s (n=%d) predicted %.4f' % (statistics.median(ts), len(ts), pred.get('predicted',0)))
PY
