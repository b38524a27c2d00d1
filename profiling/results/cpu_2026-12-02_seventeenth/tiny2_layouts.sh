#!/bin/bash
# tiny:2's two tied layouts, run alternately N times from one cached profile (issue 27, point 3):
# A = 4 sequences x 2 micro-batches, B = 8 x 1 (2 replicas, 2 stages a rank, cfg 3). Each rank's
# memory beside the plan's terms from memprobe/sitecustomize.py.
#   CACHE=<a check_predictions cache dir> bash profiling/results/cpu_2026-12-02_seventeenth/tiny2_layouts.sh 2
#   PRE="env MALLOC_MMAP_THRESHOLD_=65536" CACHE=... bash .../tiny2_layouts.sh 2   # every block >= 64 KiB mmapped
set -u
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
out=${OUTDIR:-/tmp/tiny2_layouts}
mkdir -p "$out"
base="model=tiny eval.every=0 log.progress=false optim.backend=torch checkpoint.keep=1 train.seq_len=128 device=cpu
 train.steps=20 schedule=sysx parallel.replicas=2 schedule.stages_per_rank=2 schedule.split=1 schedule.cfg=3
 schedule.param_buffers=2 optim.workers=1"
for _ in $(seq 1 "${1:-1}"); do
  for layout in A B; do
    if [ $layout = A ]; then mb="train.micro_batch_size=4 train.micro_batches=2"; else mb="train.micro_batch_size=8 train.micro_batches=1"; fi
    rm -rf "$out/run_$layout"
    # shellcheck disable=SC2086
    SYSX_CACHE_DIR=$CACHE OMP_NUM_THREADS=1 PYTHONPATH="$here/memprobe:." SYSX_MEMPROBE=1 ${PRE:-} \
      .venv/bin/python -m sysx.launch --standalone --nproc_per_node=2 -m sysx.train $base $mb run_dir="$out/run_$layout" \
      > "$out/out_$layout.txt" 2>&1
    echo "$layout $(grep -h -e MEMPROBE -e PLANPROBE "$out/out_$layout.txt" | sort | tr '\n' ' ')"
    echo "$layout $(grep -h '^prediction' "$out/out_$layout.txt")"
  done
done
