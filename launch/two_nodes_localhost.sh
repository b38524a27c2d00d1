#!/usr/bin/env bash
# Two torchrun "nodes" on this one machine: --nnodes=2 with a c10d rendezvous on localhost, NPROC
# processes per "node". sysx groups ranks into nodes by torchrun's LOCAL_WORLD_SIZE, so each "node"
# gets its own shared-memory segments (names carry the node index) and the parameters a rank runs
# forward but that a rank of the other "node" owns reach it through mirror segments, pushed by the
# owner after every optimizer step: the multi-node path, without a second machine.
#   NPROC=2 launch/two_nodes_localhost.sh schedule=sysx train.steps=20 device=cpu
#   NPROC=2 launch/two_nodes_localhost.sh parallel.replicas=2 schedule=sysx device=cpu   # a replica per "node"
# Arguments are sysx-train overrides. PORT picks the rendezvous port (default 29533); TORCHRUN_ARGS adds
# torchrun options to both "nodes" (e.g. TORCHRUN_ARGS="--max-restarts=2"). Each "node" runs
# torchrun through sysx.launch (exits like the job, no agent log lines); the script exits with the
# first non-zero status of the two.
set -euo pipefail
NPROC="${NPROC:-2}"
PORT="${PORT:-29533}"
RDZV_ID="${RDZV_ID:-sysx-2nodes-$$}"
source "$(dirname "${BASH_SOURCE[0]}")/_python.sh"  # PYTHON: the venv's interpreter, active or not
read -r -a torchrun_args <<< "${TORCHRUN_ARGS:-}"
common=(${torchrun_args[@]+"${torchrun_args[@]}"} --nnodes=2 --nproc_per_node="${NPROC}" --rdzv_backend=c10d --rdzv_endpoint="127.0.0.1:${PORT}" --rdzv_id="${RDZV_ID}")
"${PYTHON}" -m sysx.launch "${common[@]}" --node_rank=0 -m sysx.train "$@" &
node0=$!
"${PYTHON}" -m sysx.launch "${common[@]}" --node_rank=1 -m sysx.train "$@" &
node1=$!
# a signal to this script alone goes on to both "nodes" (Ctrl-C in a terminal reaches them directly)
trap 'kill -INT "${node0}" "${node1}" 2>/dev/null || true' INT
trap 'kill -TERM "${node0}" "${node1}" 2>/dev/null || true' TERM
status=0
wait "${node0}" || status=$?
wait "${node1}" || { second=$?; [ "${status}" -ne 0 ] || status="${second}"; }
exit "${status}"
