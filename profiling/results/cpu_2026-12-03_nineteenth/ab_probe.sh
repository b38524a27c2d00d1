#!/bin/bash
# Nineteenth session (issue 27): the prediction check before (4d63a58, the backward probe at the
# fewest and the most tokens, one Block against two; checked out as a worktree at /tmp/before) and
# after (the probe at every count, one Block against four, in /work/main), interleaved, tiny at 2
# and 4 ranks, each run with its own fresh profile.
# Usage: git worktree add /tmp/before 4d63a58; bash ab_probe.sh ROUNDS
mkdir -p /tmp/cp
for round in $(seq 1 "${1:-3}"); do
  for side in before after; do
    dir=$([ $side = before ] && echo /tmp/before || echo /work/main)
    echo "=== round $round $side $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $dir && PYTHONPATH=. /work/main/.venv/bin/python profiling/check_predictions.py --only tiny:2,tiny:4 --jsonl /tmp/cp/ab_$side.jsonl 2>&1 | grep '^| tiny')
  done
done
echo "=== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
