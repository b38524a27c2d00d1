#!/bin/bash
# Twentieth session (issue 27, point 3): the prediction check's single rows (torch's threads, as
# sysx-train runs) before (e007a9d in a worktree at /tmp/before) and after (/work/main),
# interleaved; both sides run this tree's check script, each in its own tree's code (PYTHONPATH=.).
# Usage: git worktree add /tmp/before e007a9d; bash ab_single_check.sh ROUNDS [RUNS]
rounds=${1:-2}; runs=${2:-single:tiny,single:50M}
mkdir -p /tmp/cp
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    dir=$([ $side = before ] && echo /tmp/before || echo /work/main)
    echo "=== round $round $side $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $dir && PYTHONPATH=. /work/main/.venv/bin/python /work/main/profiling/check_predictions.py --only "$runs" \
      --jsonl /tmp/cp/ab_single_$side.jsonl 2>&1 | grep '^| single')
  done
done
echo "=== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
