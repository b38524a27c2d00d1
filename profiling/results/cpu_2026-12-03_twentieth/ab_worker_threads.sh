#!/bin/bash
# Twentieth session (issue 27, point 3): the default job (`sysx-train`, schedule=single on the CPU,
# torch's threads) before (e007a9d, the window's optimizer workers at torch's count; a worktree at
# /tmp/before) and after (one OpenMP thread a worker on a CPU device, /work/main), interleaved,
# STEPS steps each, with its planned and measured seconds a step from the run's prediction line.
# Usage: git worktree add /tmp/before e007a9d; bash ab_worker_threads.sh ROUNDS [STEPS]
rounds=${1:-3}; steps=${2:-40}
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    dir=$([ $side = before ] && echo /tmp/before || echo /work/main)
    echo "=== round $round $side $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $dir && PYTHONPATH=. /work/main/.venv/bin/python -m sysx.train train.steps="$steps" eval.every=0 \
      log.progress=false run_dir="/tmp/ab_threads/$side$round" 2>&1 | grep -E '^(prediction|done)')
  done
done
echo "=== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
