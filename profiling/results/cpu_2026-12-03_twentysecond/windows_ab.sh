#!/bin/bash
# A: HEAD's together windows (3 x 0.3 s); B: 7 x 0.5 s. Alternating, one round of the tiny pipeline rows each.
OUT=/work/main/profiling/results/cpu_2026-12-03_twentysecond
for i in 1 2 3 4; do
  for v in A B; do
    dir=/work/main; [ $v = B ] && dir=/tmp/wt_long
    cd $dir && PYTHONPATH=. /work/main/.venv/bin/python /work/main/profiling/check_predictions.py --rounds 1 --only tiny:2,tiny:4 \
      --jsonl $OUT/windows_$v.jsonl 2>&1 | grep -E "^tiny" | cut -c1-160 | sed "s/^/$v $i /"
  done
done
