#!/usr/bin/env bash
# Launch sysx-train on this machine with torchrun, one process per GPU (or NPROC processes).
#   NPROC=4 launch/torchrun.sh schedule=<multi-process schedule> train.steps=100
# Arguments are sysx-train overrides. Rank and world size reach sysx through torchrun's environment
# (RANK, WORLD_SIZE, LOCAL_RANK); Hydra creates no directories and rank 0 alone writes run_dir.
# schedule=reference runs in one process only: use `sysx-train` directly (or NPROC=1) for it.
set -euo pipefail
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))' 2>/dev/null || echo 1)
fi
exec torchrun --standalone --nproc_per_node="${NPROC}" -m sysx.train "$@"
