#!/bin/bash
# tiny:2 winners with one and two stages a rank (fixed layouts, 50 steps, HEAD 8159067), the step taken apart per
# step 10-49 by the twenty-third session's spans probe (site/sitecustomize.py), run twice each, interleaved
SITE=/work/main/profiling/results/cpu_2026-12-03_twentythird/site
for i in 1 2; do
for spr in 1 2; do
  rm -f /tmp/p23/spans-*.json; rm -rf /tmp/p24/spr$spr
  (cd /work/main && OMP_NUM_THREADS=1 SYSX_SPANS=1 PYTHONPATH=.:$SITE .venv/bin/python -m sysx.launch --standalone --nproc_per_node=2 -m sysx.train schedule=sysx parallel.replicas=2 schedule.stages_per_rank=$spr schedule.split=1 schedule.cfg=3 train.micro_batch_size=8 train.micro_batches=1 schedule.param_buffers=$spr optim.workers=1 model=tiny eval.every=0 log.progress=false optim.backend=torch checkpoint.keep=1 train.seq_len=128 device=cpu train.steps=50 run_dir=/tmp/p24/spr$spr > /tmp/p24/spr$spr.log 2>&1)
  python3 /work/main/profiling/results/cpu_2026-12-03_twentyfourth/spr_report.py spr$spr.$i
done
done
