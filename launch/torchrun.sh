#!/usr/bin/env bash
# Launch sysx-train with torchrun, one process per GPU (or NPROC processes on CPU).
#   NPROC=4 launch/torchrun.sh schedule=sysx train.steps=100                    # this machine
#   NNODES=2 NODE_RANK=0 MASTER=host0:29533 launch/torchrun.sh schedule=sysx    # on host0
#   NNODES=2 NODE_RANK=1 MASTER=host0:29533 launch/torchrun.sh schedule=sysx    # on host1
#   NPROC=4 launch/torchrun.sh parallel.replicas=2 schedule=sysx                # 2 replicas x 2 pipeline ranks
# With parallel.replicas=R the processes (NPROC x NNODES) are R replicas of a pipeline of the rest;
# the pre-flight plans that layout and refuses a process count R does not divide.
# torchrun runs through sysx.launch, which exits like the job (130/143 after Ctrl-C/SIGTERM, no
# traceback of torchrun's agent). Arguments are sysx-train overrides. Rank, world size and the node layout reach sysx through
# torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); Hydra creates no
# directories and rank 0 alone writes run_dir. With NNODES > 1 every node runs this script with its
# NODE_RANK and the same MASTER (host:port of node 0) and RDZV_ID (default: sysx-<MASTER>).
# TORCHRUN_ARGS adds torchrun options, e.g. restarts after a failure (with train.resume=auto and
# checkpoint.every, the restarted job resumes from the last complete checkpoint):
#   TORCHRUN_ARGS="--max-restarts=2" NPROC=4 launch/torchrun.sh checkpoint.every=100
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_python.sh"  # PYTHON: the venv's interpreter, active or not
read -r -a torchrun_args <<< "${TORCHRUN_ARGS:-}"
if [ -z "${NPROC:-}" ]; then
  NPROC=$("${PYTHON}" -c 'import torch; print(max(torch.cuda.device_count(), 1))' 2>/dev/null || echo 1)
fi
NNODES="${NNODES:-1}"
if [ "${NNODES}" -eq 1 ]; then
  "${PYTHON}" -m sysx.train --check --ranks "${NPROC}" "$@"  # pre-flight: one line and exit 2 if the job would fail
  exec "${PYTHON}" -m sysx.launch --standalone --nproc_per_node="${NPROC}" ${torchrun_args[@]+"${torchrun_args[@]}"} \
    -m sysx.train "$@"
fi
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1) for this node}"
: "${MASTER:?set MASTER=host:port of node 0 (the rendezvous endpoint)}"
exec "${PYTHON}" -m sysx.launch --nnodes="${NNODES}" --node_rank="${NODE_RANK}" --nproc_per_node="${NPROC}" \
  --rdzv_backend=c10d --rdzv_endpoint="${MASTER}" --rdzv_id="${RDZV_ID:-sysx-${MASTER}}" \
  ${torchrun_args[@]+"${torchrun_args[@]}"} -m sysx.train "$@"
