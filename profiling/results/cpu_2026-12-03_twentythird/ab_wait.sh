#!/bin/bash
# A/B: collectives polled (A, as now) vs blocking wait in 0.1-s slices (B), tiny, 2 replicas, fixed layout, interleaved
cd /work/main
export SYSX_CACHE_DIR=/tmp/p23/cache1 OMP_NUM_THREADS=1 PYTHONPATH=/work/main/profiling/results/cpu_2026-12-03_twentythird/site
for i in $(seq 1 ${1:-6}); do
  for v in A B; do
    rm -rf /tmp/p23/ab_$v
    if [ $v = B ]; then export SYSX_BLOCKWAIT=1; else unset SYSX_BLOCKWAIT; fi
    .venv/bin/python -m sysx.launch --standalone --nproc_per_node=2 -m sysx.train schedule=sysx parallel.replicas=2 schedule.stages_per_rank=1 schedule.split=1 schedule.cfg=3 train.micro_batch_size=8 train.micro_batches=1 schedule.param_buffers=1 optim.workers=1 model=tiny eval.every=0 log.progress=false optim.backend=torch checkpoint.keep=1 train.seq_len=128 device=cpu train.steps=${2:-60} run_dir=/tmp/p23/ab_$v > /tmp/p23/ab_$v.log 2>&1
    python3 -c "
import json,statistics as st
rows=[json.loads(l) for l in open('/tmp/p23/ab_$v/metrics.jsonl')]
t=[r['step_time_s'] for r in rows if r['step']>=10]
print('$v', $i, 'mean %.4f median %.4f' % (st.fmean(t), st.median(t)), 'load', open('/proc/loadavg').read().split()[0], flush=True)"
  done
done
