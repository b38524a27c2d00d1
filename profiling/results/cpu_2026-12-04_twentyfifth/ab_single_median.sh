#!/bin/bash
# single:tiny, the check's command, A (8846a59: pass windows' mean over rounds) and B (the median) in
# N interleaved pairs, each run with a fresh profile cache, nothing else running. B was a change in
# the work tree (mean_in_rounds(..., median=True) in sysx.single.pass_timing), not kept: see RESULTS.md
N=${1:-6}
for i in $(seq 1 "$N"); do
  for side in A B; do
    rm -rf /tmp/p25/run /tmp/p25/cache
    if [ $side = A ]; then cd /tmp/old25; export PYTHONPATH=.; else cd /work/main; unset PYTHONPATH; fi
    SYSX_CACHE_DIR=/tmp/p25/cache /work/main/.venv/bin/python -m sysx.train schedule=single model=tiny \
      eval.every=0 log.progress=false optim.backend=torch checkpoint.keep=1 train.seq_len=128 device=cpu \
      train.steps=20 run_dir=/tmp/p25/run > /tmp/p25/out.txt 2>&1
    python3 - "$i" "$side" <<'PY'
import json, sys
p = json.load(open("/tmp/p25/run/summary.json"))["prediction"]["iteration_s"]
print(f"{sys.argv[1]} {sys.argv[2]}: predicted {p['predicted']:.3f} measured {p['measured']:.3f} error {p['error_pct']:+.1f}%")
PY
  done
done
