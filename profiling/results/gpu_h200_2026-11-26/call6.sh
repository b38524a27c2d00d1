#!/usr/bin/env bash
# device call 6: the pipeline's CUDA path after page-locking by the job's device: sysx and gpipe, 3 steps under the CUDA sanitizer vs CPU; the store's segments registered
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
timeout 150 python3 -c "
import sys; sys.argv=['gpu_check.py']; sys.path.insert(0,'profiling')
import gpu_check
gpu_check.SCHEDULES=('sysx','gpipe')
gpu_check.check_losses(True)
" 2>&1 | tail -8
timeout 60 python3 -c "
import torch
from sysx.config import load_config
from sysx.runtime import PipelineOptions
from sysx.trainers.pipeline import PipelineTrainer
for device in ('cuda', 'cpu'):
    t = PipelineTrainer(load_config(['model=tiny','train.seq_len=32','train.micro_batch_size=2','train.micro_batches=2','eval.every=0','device='+device,'precision=fp32']), PipelineOptions(optim_backend='torch', schedule='sysx'))
    t.run(1)
    st = t.params.store
    print(device, 'segments pinned:', sorted({b.pinned for b in st._stages.values()}), 'grads pinned:', t.optimizer.buffers.pin)
    t.close()
" 2>&1 | grep -v "^  \|^sysx-train\|^step" | tail -6
