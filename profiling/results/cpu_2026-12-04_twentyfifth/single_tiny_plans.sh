#!/bin/bash
# single:tiny, the check's command 8 times in a row (each with its own profile cache, as the check's
# rounds have), nothing else running: the plan line, the predicted and measured seconds per step
cd /work/main
for i in 1 2 3 4 5 6 7 8; do
  rm -rf /tmp/p25/run /tmp/p25/cache
  SYSX_CACHE_DIR=/tmp/p25/cache .venv/bin/python -m sysx.train schedule=single model=tiny eval.every=0 \
    log.progress=false optim.backend=torch checkpoint.keep=1 train.seq_len=128 device=cpu train.steps=20 \
    run_dir=/tmp/p25/run > /tmp/p25/out.txt 2>&1
  plan=$(grep -m1 -iE "window|W=" /tmp/p25/out.txt | cut -c1-160)
  python3 - "$i" "$plan" <<'PY'
import json, sys
p = json.load(open("/tmp/p25/run/summary.json"))["prediction"]["iteration_s"]
print(f"{sys.argv[1]}: predicted {p['predicted']:.3f} measured {p['measured']:.3f} error {p['error_pct']:+.1f}% | {sys.argv[2]}")
PY
done
