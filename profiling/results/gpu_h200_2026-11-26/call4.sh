#!/usr/bin/env bash
# device call 4: the GPU-host test failure in full; the GPU single rows after the serial lane pricing; placement=cpu beside; py-spy of the window's main thread
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
t0=$(date +%s); K=/tmp/keep; mkdir -p $K
{
echo "== pytest ($(cat /proc/loadavg))"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_placement_window.py -k bit_identical 2>&1 | grep -v "^  " | tail -40
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_trace.py tests/test_host_costs.py tests/test_placement_window.py -k "not bit_identical" 2>&1 | tail -3
echo "== cuda single at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
timeout 45 python3 profiling/check_predictions.py --device cuda --only single:tiny --timeout 40 --keep $K/auto --set 'profile.timeline_steps=[8,10]' --jsonl $OUT/pred.jsonl | tail -1
timeout 45 python3 profiling/check_predictions.py --device cuda --only single:50M --timeout 40 --keep $K/auto --cache $K/auto/cache --set 'profile.timeline_steps=[2,3]' --jsonl $OUT/pred.jsonl | tail -1
timeout 45 python3 profiling/check_predictions.py --device cuda --only single:50M --timeout 40 --keep $K/cpu --cache $K/auto/cache --set 'profile.timeline_steps=[2,3]' --set optim.placement=cpu --jsonl $OUT/pred.jsonl | tail -1
echo "== py-spy single:50M placement=cpu at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
SYSX_CACHE_DIR=$K/auto/cache OMP_NUM_THREADS=1 timeout 80 .gpu/py-spy record -r 250 --format raw -o $OUT/pyspy_cpu50M.txt --threads -- python3 -m sysx.train schedule=single model=tiny model.dim=512 model.n_layers=16 model.n_heads=8 model.n_kv_heads=8 model.ffn_dim=1376 eval.every=0 log.progress=false optim.backend=torch optim.placement=cpu checkpoint.keep=1 train.seq_len=128 device=cuda train.steps=15 run_dir=$K/spy 2>&1 | tail -3
echo "== done at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
} 2>&1 | tee $OUT/call4.log
cd $K && tar czf $OUT/runs.tgz --exclude=checkpoints --exclude='*.safetensors' --exclude=data auto cpu spy 2>/dev/null; ls -la $OUT
