#!/bin/bash
# Eighteenth session (issue 27): the prediction check before (f37e3d9, torch._dynamo imported before
# each rank's host baseline, checked out as a worktree at /tmp/before) and after (b613b71, in
# /work/main), interleaved. Usage: git worktree add /tmp/before f37e3d9; bash ab_dynamo.sh
# before (f37e3d9) and after (b613b71) interleaved, tiny at 2 and 4 ranks, each with its own fresh profile
for round in 1 2; do
  for side in before after; do
    dir=$([ $side = before ] && echo /tmp/before || echo /work/main)
    echo "=== round $round $side $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $dir && PYTHONPATH=. /work/main/.venv/bin/python profiling/check_predictions.py --only tiny:2,tiny:4 --jsonl /tmp/cp/$side.jsonl 2>&1 | tail -8)
  done
done
echo "=== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
