#!/bin/bash
# A/B, interleaved: the check's tiny rows with the meeting rounds ended by one all-reduce (A: HEAD
# 8159067, a worktree at /tmp/p24/wt_a) against rounds ended as a step ends (B: the working tree then,
# STEP_END_COLLECTIVES=3 with hand-offs, 9 rounds, the meeting charged in place of the modelled
# all-reduces); each run a fresh profile cache (one per invocation). Usage: ab_meeting.sh PAIRS
OUT=/work/main/profiling/results/cpu_2026-12-03_twentyfourth
for i in $(seq 1 ${1:-6}); do
  for v in A B; do
    dir=/work/main; [ $v = A ] && dir=/tmp/p24/wt_a
    cd $dir && PYTHONPATH=. /work/main/.venv/bin/python /work/main/profiling/check_predictions.py --rounds 1 \
      --only tiny:2,tiny:4 --jsonl $OUT/meeting_$v.jsonl 2>&1 | grep -E "^\| tiny:" | sed "s/^/$v $i /"
  done
done
