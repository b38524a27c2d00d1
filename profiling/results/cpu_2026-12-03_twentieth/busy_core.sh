#!/bin/bash
# Twentieth session (issue 27): the default job, 40 steps, twice under each OpenMP setting, idle and
# with a busy loop holding one core; prints each run's mean tokens/s (busy_core.log).
# Usage: bash busy_core.sh   (in /work/main, its .venv)
cd /work/main
run() { env "$@" PYTHONPATH=. .venv/bin/python -m sysx.train train.steps=40 eval.every=0 log.progress=false \
  run_dir=/tmp/busy_core/$RANDOM 2>&1 | grep -E '^done' | sed 's/.*mean \([0-9.k]*\) tok.*/\1/'; }
settings=("GOMP_SPINCOUNT=0" "GOMP_SPINCOUNT=3000" "GOMP_SPINCOUNT=30000" "OMP_NUM_THREADS=1" "SYSX_UNSET=1")
for side in idle held; do
  [ $side = held ] && { python3 -c 'while True: pass' & hog=$!; trap 'kill $hog' EXIT; sleep 1; }
  echo "$side $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  for s in "${settings[@]}"; do echo "  $s: $(run "$s") $(run "$s")"; done
done
