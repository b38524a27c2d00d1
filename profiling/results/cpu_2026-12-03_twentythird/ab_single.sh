#!/bin/bash
# A/B, interleaved: the single-device planner's site times over 3 runs (A: HEAD 25d5942, a worktree at
# /tmp/p23/wt_a) against at least 0.3 s of runs (B: the working tree then, `profile_layer` timing runs until 0.3 s
# had passed; not kept); the check's single:tiny row, a
# fresh profile cache each run (check_predictions.py makes one per invocation).
OUT=/work/main/profiling/results/cpu_2026-12-03_twentythird
for i in $(seq 1 ${1:-6}); do
  for v in A B; do
    dir=/work/main; [ $v = A ] && dir=/tmp/p23/wt_a
    cd $dir && PYTHONPATH=. /work/main/.venv/bin/python /work/main/profiling/check_predictions.py --rounds 1 --only single:tiny \
      --jsonl $OUT/single_$v.jsonl 2>&1 | grep -E "^\| single:tiny \(" | sed "s/^/$v $i /"
  done
done
