#!/bin/bash
# A = HEAD before the change, checked out with `git worktree add /tmp/p23/wt_head 4e440d6`; the profile cache /tmp/p23/cache1 from a tuned tiny:2 run.
# A/B, interleaved: HEAD (A: collectives polled) against the working tree (B: waited for in Work.wait slices).
# The tuned tiny:2 and tiny:4 winners as fixed layouts, 60 steps; mean step time over steps 10-59.
cd /work/main  # each run cds into its tree: the editable install would win over PYTHONPATH from elsewhere
export SYSX_CACHE_DIR=/tmp/p23/cache1 OMP_NUM_THREADS=1
unset SYSX_BLOCKWAIT SYSX_SPANS
declare -A TREE=([A]=/tmp/p23/wt_head [B]=/work/main)
declare -A LAYOUT=(
  [tiny2]="--nproc_per_node=2 -m sysx.train parallel.replicas=2 train.micro_batch_size=8"
  [tiny4]="--nproc_per_node=4 -m sysx.train parallel.replicas=4 train.micro_batch_size=4")
for i in $(seq 1 ${1:-6}); do
  for row in tiny2 tiny4; do
    for v in A B; do
      d=/tmp/p23/abr_${row}_$v; rm -rf $d
      cd ${TREE[$v]} && PYTHONPATH=. /work/main/.venv/bin/python -m sysx.launch --standalone ${LAYOUT[$row]} schedule=sysx schedule.stages_per_rank=1 schedule.split=1 schedule.cfg=3 train.micro_batches=1 schedule.param_buffers=1 optim.workers=1 model=tiny eval.every=0 log.progress=false optim.backend=torch checkpoint.keep=1 train.seq_len=128 device=cpu train.steps=60 run_dir=$d > $d.log 2>&1 || echo "run failed: $row $v"
      python3 -c "
import json,statistics as st
rows=[json.loads(l) for l in open('$d/metrics.jsonl')]
t=[r['step_time_s'] for r in rows if r['step']>=10]
print('$row', '$v', $i, 'mean %.4f median %.4f' % (st.fmean(t), st.median(t)), 'load', open('/proc/loadavg').read().split()[0], flush=True)"
    done
  done
done
