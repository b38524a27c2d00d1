#!/usr/bin/env bash
# Launch sysx-train with MPI (mpiexec from MPICH/Open MPI; the venv's mpich wheel provides one), one
# process per GPU (or NP processes on CPU). sysx reads rank, size and local rank from MPI through
# mpi4py, groups ranks into nodes by a shared-memory split of COMM_WORLD, and rank 0 broadcasts the
# rendezvous address (MPI launchers set no MASTER_ADDR/MASTER_PORT).
#   NP=4 launch/mpirun.sh schedule=sysx train.steps=20 device=cpu
#   NP=16 HOSTS=node1:8,node2:8 launch/mpirun.sh schedule=sysx        # several nodes (MPICH host list)
#   NP=16 HOSTS=node1:8,node2:8 launch/mpirun.sh parallel.replicas=2 schedule=sysx   # a replica per node
# Arguments are sysx-train overrides. MPIEXEC overrides the launcher (default: the venv's mpiexec, else
# the one on PATH); PYTHON the interpreter (default: the active venv's, else this checkout's .venv).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_python.sh"  # PYTHON: the venv's interpreter, active or not
if [ -z "${NP:-}" ]; then
  NP=$("${PYTHON}" -c 'import torch; print(max(torch.cuda.device_count(), 1))' 2>/dev/null || echo 1)
fi
if [ -z "${MPIEXEC:-}" ]; then  # the venv's mpiexec (mpich wheel) beside its interpreter, else the one on PATH
  MPIEXEC="$(dirname "${PYTHON}")/mpiexec"
  [ -x "${MPIEXEC}" ] || MPIEXEC=mpiexec
fi
hosts=()
if [ -n "${HOSTS:-}" ]; then
  hosts=(-hosts "${HOSTS}")
fi
if [ -z "${HOSTS:-}" ]; then  # pre-flight (one node): one line and exit 2 if the job would fail
  "${PYTHON}" -m sysx.train --check --ranks "${NP}" "$@"
fi
exec "${MPIEXEC}" -n "${NP}" "${hosts[@]}" "${PYTHON}" -m sysx.train "$@"
