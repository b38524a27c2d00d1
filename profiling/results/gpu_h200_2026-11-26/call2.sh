#!/usr/bin/env bash
# device call 2: timelines of the CPU rows that missed on the 16-core host; the GPU single rows kept; py-spy of the GPU window
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
t0=$(date +%s); K=/tmp/keep; mkdir -p $K
log=$OUT/call2.log
{
echo "== cpu job leaves CUDA alone ($(cat /proc/loadavg))"
timeout 60 python3 -c "
import torch
from sysx.config import load_config
from sysx.trainers.single import SingleTrainer
t = SingleTrainer(load_config(['model=tiny','train.seq_len=32','train.micro_batch_size=2','train.micro_batches=1','eval.every=0','device=cpu','schedule=single','optim.backend=torch']))
t.run(2); t.close()
print('device=cpu single: torch.cuda.is_initialized() =', torch.cuda.is_initialized())
"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_readiness.py 2>&1 | tail -2
echo "== tiny timelines at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
timeout 150 python3 profiling/check_predictions.py --device cpu --only tiny:2,tiny:4 --timeout 70 --keep $K/cpu --set 'profile.timeline_steps=[8,10]' --jsonl $OUT/pred.jsonl | tail -4
echo "== 50M:4 timeline at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
timeout 100 python3 profiling/check_predictions.py --device cpu --only 50M:4 --timeout 90 --keep $K/cpu --cache $K/cpu/cache --set 'profile.timeline_steps=[2,3]' --jsonl $OUT/pred.jsonl | tail -3
echo "== cuda single timelines at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
timeout 60 python3 profiling/check_predictions.py --device cuda --only single:tiny --timeout 50 --keep $K/cuda --set 'profile.timeline_steps=[8,10]' --jsonl $OUT/pred.jsonl | tail -3
timeout 60 python3 profiling/check_predictions.py --device cuda --only single:50M --timeout 50 --keep $K/cuda --cache $K/cuda/cache --set 'profile.timeline_steps=[2,3]' --jsonl $OUT/pred.jsonl | tail -3
echo "== py-spy of cuda single:50M, 12 steps at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
SYSX_CACHE_DIR=$K/cuda/cache OMP_NUM_THREADS=1 timeout 100 .gpu/py-spy record -r 200 --format raw -o $OUT/pyspy_single50M.txt --threads --idle -- python3 -m sysx.train schedule=single model=tiny model.dim=512 model.n_layers=16 model.n_heads=8 model.n_kv_heads=8 model.ffn_dim=1376 eval.every=0 log.progress=false optim.backend=torch checkpoint.keep=1 train.seq_len=128 device=cuda train.steps=12 run_dir=$K/spy 2>&1 | tail -8
echo "== done at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
} 2>&1 | tee $log
cd $K && tar czf $OUT/runs.tgz --exclude=checkpoints --exclude='*.pt' --exclude='*.safetensors' --exclude='cache/*/*.bin' cpu cuda spy 2>/dev/null; ls -la $OUT
