#!/bin/bash
# tiny:2's two winners, fixed: one and two stages a rank (2 replicas, micro_batch_size 8), interleaved, the check's
# settings and measurement (steps 1-12..15 of 20), a profile cached by a tuned tiny:2 run first
# (PYTHONPATH=. python profiling/check_predictions.py --only tiny:2 --rounds 1 --cache /tmp/s26/cache):
#   ROUNDS="a b c d e f" bash profiling/results/cpu_2026-12-04_twentysixth/ab_stages.sh
# prints each run's prediction section (predicted from the cached profile, without the tune's measured
# slowdown and meeting)
cd "$(dirname "$0")/../../.."
for i in ${ROUNDS:-1}; do
for spr in 1 2; do
  rm -rf /tmp/s26/spr$spr.$i
  SYSX_CACHE_DIR=/tmp/s26/cache OMP_NUM_THREADS=1 .venv/bin/python -m sysx.launch --standalone --nproc_per_node=2 -m sysx.train schedule=sysx parallel.replicas=2 schedule.stages_per_rank=$spr schedule.split=1 schedule.cfg=3 train.micro_batch_size=8 train.micro_batches=1 schedule.param_buffers=$spr optim.workers=1 model=tiny eval.every=0 log.progress=false optim.backend=torch checkpoint.keep=1 train.seq_len=128 device=cpu train.steps=20 run_dir=/tmp/s26/spr$spr.$i > /tmp/s26/spr$spr.$i.log 2>&1
  echo "spr$spr.$i rc=$? $(python3 -c "import json,sys; print(json.load(open('/tmp/s26/spr$spr.$i/summary.json')).get('prediction'))")"
done; done
