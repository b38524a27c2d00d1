#!/usr/bin/env bash
# A/B: GIL switch interval default (5 ms) vs 0.5 ms, tiny:2's winner layout fixed, interleaved
cd "$(git rev-parse --show-toplevel)"
for i in 1 2 3; do
 for sw in "" 0.0005; do
  rm -rf /tmp/gil_ab_run
  SYSX_EXP_SWITCH=$sw PYTHONPATH=profiling/results/cpu_2026-11-26_fifth:. OMP_NUM_THREADS=1 SYSX_CACHE_DIR=/tmp/gil_ab_cache timeout 300 .venv/bin/python -m sysx.launch --standalone --nproc_per_node=2 -m sysx.train model=tiny schedule=sysx parallel.replicas=2 schedule.stages_per_rank=2 schedule.split=1 train.micro_batch_size=8 train.micro_batches=1 train.seq_len=128 optim.backend=torch train.steps=40 eval.every=0 log.progress=false 'profile.timeline_steps=[10,39]' run_dir=/tmp/gil_ab_run > /tmp/gil_ab_out.txt 2>&1
  echo "switch=${sw:-default} load=$(cut -d' ' -f1 /proc/loadavg) $(grep -E '^timeline:' /tmp/gil_ab_out.txt | sed 's/|.*//') $(grep '^replicas:' /tmp/gil_ab_out.txt | cut -c1-80)"
 done
done
