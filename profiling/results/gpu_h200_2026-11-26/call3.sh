#!/usr/bin/env bash
# device call 3: after the fixes (pin by job device, device-lane boxes, pageable lane rates): tests, the CPU table, GPU single rows, the quick start on the GPU
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
t0=$(date +%s); K=/tmp/keep; mkdir -p $K
{
echo "== pytest ($(cat /proc/loadavg))"
timeout 110 python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu_readiness.py tests/test_placement_window.py tests/test_trace.py tests/test_host_costs.py -k "not gpu_check_runs" 2>&1 | tail -3
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -2
echo "== cpu table at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
timeout 270 python3 profiling/check_predictions.py --device cpu --timeout 80 --keep $K/cpu --jsonl $OUT/pred.jsonl | tail -9
echo "== cuda single at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
timeout 45 python3 profiling/check_predictions.py --device cuda --only single:tiny --timeout 40 --keep $K/cuda --set 'profile.timeline_steps=[8,10]' --jsonl $OUT/pred.jsonl | tail -1
timeout 45 python3 profiling/check_predictions.py --device cuda --only single:50M --timeout 40 --keep $K/cuda --cache $K/cuda/cache --set 'profile.timeline_steps=[2,3]' --jsonl $OUT/pred.jsonl | tail -1
left=$(( 575 - ($(date +%s) - t0) ))
echo "== quick start (python3 -m sysx.train, no overrides) at $(( $(date +%s) - t0 )) s, ${left} s left ($(cat /proc/loadavg))"
mkdir -p $K/qs && cd $K/qs && timeout $left python3 -m sysx.train > $K/qs/output.txt 2>&1; echo "exit $?"; grep -v "^step " $K/qs/output.txt | tail -12; grep "^step " $K/qs/output.txt | tail -3; cd - >/dev/null
echo "== done at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
} 2>&1 | tee $OUT/call3.log
cd $K && tar czf $OUT/runs.tgz --exclude=checkpoints --exclude='*.safetensors' cpu cuda qs 2>/dev/null; ls -la $OUT
