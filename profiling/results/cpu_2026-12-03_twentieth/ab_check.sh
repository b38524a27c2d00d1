#!/bin/bash
# Twentieth session (issue 27, point 3): rows of the prediction check before (e007a9d, a worktree
# at /tmp/before) and after (/work/main), interleaved; both sides run this tree's check script,
# each in its own tree's code (PYTHONPATH=.), appending to /tmp/cp/ab_TAG_{before,after}.jsonl.
# Usage: git worktree add /tmp/before e007a9d; bash ab_check.sh ROUNDS RUNS TAG [check options]
#   the single rows with torch's threads: bash ab_check.sh 2 single:tiny,single:50M single
#   DeepSpeed's op (the default optim.backend): bash ab_check.sh 2 tiny:2,single:tiny ds --set optim.backend=auto
rounds=$1; runs=$2; tag=$3; shift 3
mkdir -p /tmp/cp
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    dir=$([ $side = before ] && echo /tmp/before || echo /work/main)
    echo "=== round $round $side $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $dir && PYTHONPATH=. /work/main/.venv/bin/python /work/main/profiling/check_predictions.py --only "$runs" \
      --jsonl "/tmp/cp/ab_${tag}_$side.jsonl" "$@" 2>&1 | grep -E '^\| (tiny|single|50M)')
  done
done
echo "=== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
