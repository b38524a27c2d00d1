#!/usr/bin/env bash
# device call 5: test_trace on the GPU host with its errors in full; the GPU single rows with the job rate and the optimizer's hold priced
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
t0=$(date +%s); K=/tmp/keep; mkdir -p $K
{
echo "== cuda single ($(cat /proc/loadavg))"
timeout 45 python3 profiling/check_predictions.py --device cuda --only single:tiny --timeout 40 --keep $K/auto --jsonl $OUT/pred.jsonl | tail -1
timeout 45 python3 profiling/check_predictions.py --device cuda --only single:50M --timeout 40 --keep $K/auto --cache $K/auto/cache --jsonl $OUT/pred.jsonl | tail -1
timeout 45 python3 profiling/check_predictions.py --device cuda --only single:50M --timeout 40 --keep $K/cpu --cache $K/auto/cache --set optim.placement=cpu --jsonl $OUT/pred.jsonl | tail -1
grep -h "predicted:\|optim.placement\|prediction" $K/auto/*/output.txt $K/cpu/*/output.txt
echo "== test_trace and test_placement_window at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_trace.py tests/test_placement_window.py 2>&1 | grep -v "^  " | tail -45
echo "== done at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
} 2>&1 | tee $OUT/call5.log
