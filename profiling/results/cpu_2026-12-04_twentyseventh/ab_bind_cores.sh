#!/bin/bash
# tiny:2 as the check runs it (tuned, its own profile each run), parallel.bind_cores=false (b0) against
# true (b1), interleaved; each line: the prediction and the measured steps' min, median and max (the
# .out files' were taken one step early, from step-1 to step-1 of the measured window)
#   ROUNDS="a b c d e f" bash profiling/results/cpu_2026-12-04_twentyseventh/ab_bind_cores.sh
# The first A/B, before the key existed (ab_bind_after_tune.out): MODE=patch, with bind_after_tune.patch
# applied, pins b1's ranks after the tune (its profile measured unpinned) through SYSX_BIND_EXPERIMENT.
cd "$(dirname "$0")/../../.."
for i in ${ROUNDS:-1}; do
for b in 0 1; do
  if [ "${MODE:-key}" = patch ]; then pin=(SYSX_BIND_EXPERIMENT=$b); key=(); else
    pin=(); key=(parallel.bind_cores=$([ $b = 1 ] && echo true || echo false)); fi
  d=/tmp/s27/bind/run2_b$b.$i; rm -rf $d
  env "${pin[@]}" OMP_NUM_THREADS=1 SYSX_CACHE_DIR=/tmp/s27/bind/cache2_b$b.$i .venv/bin/python -m sysx.launch --standalone --nproc_per_node=2 -m sysx.train schedule=auto schedule.tune=true train.micro_batch_size=2 train.micro_batches=8 model=tiny eval.every=0 log.progress=false optim.backend=torch checkpoint.keep=1 train.seq_len=128 device=cpu train.steps=20 "${key[@]}" run_dir=$d > $d.log 2>&1
  echo "b$b.$i rc=$? load=$(cut -d' ' -f1 /proc/loadavg) $(python3 -c "
import json,statistics as st
s=json.load(open('$d/summary.json')); p=s['prediction']; a,b=p['steps']
t=[json.loads(l) for l in open('$d/metrics.jsonl')]
t=[r['step_time_s'] for r in t if a<=r['step']<=b]
print('plan %.4f meas %.4f err %+.1f%% min %.4f med %.4f max %.4f'%(p['iteration_s']['predicted'],p['iteration_s']['measured'],p['iteration_s']['error_pct'],min(t),st.median(t),max(t)))
")"
  sleep 5
done; done
