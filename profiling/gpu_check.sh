#!/usr/bin/env bash
# One command for a lent GPU (issue 17): under 8 minutes on an H100, log in $OUT/gpu_check.log
# ($OUT when set, else the current directory). Runs `pytest -m gpu`; a 1-process pipeline (sysx,
# gpipe) and the sliding window with device=cuda for 3 steps under TORCH_CUDA_SANITIZER=1, losses
# compared with device=cpu at 1e-4; shared-memory host->device GB/s with the segment registered
# (and the copy call's return time); pinned bytes held vs requested; max_memory_reserved,
# mem_get_info and NVML usage against the budget after a schedule=single run of a ~1B shape.
# Without CUDA it runs the CPU half and prints one "SKIP (no CUDA): ..." line per part left out.
#
# On the GPU machine, wheels gathered by shared/gpu/wheels.sh into .whl/ are installed first.
# GPU_CHECK_PYTEST_ARGS adds arguments to the pytest run (e.g. --co to only collect).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.}
mkdir -p "$out"
log="$out/gpu_check.log"
py=${PYTHON:-python3}
{
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
  start=$(date +%s)
  cuda=$("$py" -c "import torch; print(int(torch.cuda.is_available()))")
  echo "== pytest -m gpu"
  if [ "$cuda" = 1 ]; then
    timeout 300 "$py" -m pytest -m gpu -q -p no:cacheprovider ${GPU_CHECK_PYTEST_ARGS:-} tests
    echo "pytest -m gpu: exit $?"
  else
    echo "SKIP (no CUDA): pytest -m gpu (the gpu-marked tests skip themselves here)"
  fi
  timeout 420 "$py" profiling/gpu_check.py all
  echo "gpu_check.py: exit $?"
  echo "gpu_check: done in $(( $(date +%s) - start )) s"
} 2>&1 | tee "$log"
