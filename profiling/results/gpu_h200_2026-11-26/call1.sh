#!/usr/bin/env bash
# device call 1: regression of the CUDA paths, then the prediction check on this idle 16-core host
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
t0=$(date +%s)
{ date -u; cat /proc/loadavg; nvidia-smi; nproc; lscpu; free -g; df -h /dev/shm /tmp; python3 -c "import torch;print(torch.__version__, torch.cuda.get_device_name())"; } > $OUT/env.txt 2>&1
echo "== pytest -m gpu ($(cat /proc/loadavg))"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee $OUT/pytest_gpu.log | tail -15
echo "== check_predictions cpu at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
timeout 280 python3 profiling/check_predictions.py --device cpu --timeout 150 --jsonl $OUT/pred_cpu.jsonl 2>&1 | tee $OUT/pred_cpu.log | tail -12
echo "== check_predictions cuda single at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
timeout 100 python3 profiling/check_predictions.py --device cuda --only single:tiny,single:50M --timeout 90 --jsonl $OUT/pred_cuda.jsonl 2>&1 | tee $OUT/pred_cuda.log | tail -6
echo "== done at $(( $(date +%s) - t0 )) s ($(cat /proc/loadavg))"
