#!/usr/bin/env bash
# Nsight Systems over a torchrun job: one report per rank, capturing only the steps STEPS.
#   NPROC=4 STEPS=3,5 profiling/nsys.sh schedule=sysx model=llama2_7b train.steps=8
# Every rank runs under its own `nsys profile` (torchrun --no-python), writing
# $OUT/sysx_<RANK>.nsys-rep; the capture range is the CUDA profiler API, which the job opens before
# step STEPS's first and closes after its last (profile.nsys_steps=[first,last]), with NVTX ranges on
# every op, copy and optimizer job (profile.nvtx=true). Arguments are sysx-train overrides; add
# profile.timeline_steps=[3,5] to record the same steps with sysx's own recorder too.
# Environment: NPROC (default: the GPUs here), STEPS (default 3,5), OUT (default
# profiling/nsys-<time>), NSYS (default: nsys on PATH), PYTHON (default: python).
# profiling/README.md shows how to open the reports (nsys-ui, nsys stats).
set -euo pipefail
NSYS="${NSYS:-nsys}"
PY="$(command -v "${PYTHON:-python}")"
if ! command -v "${NSYS}" > /dev/null; then
  echo "profiling/nsys.sh: ${NSYS} not found; install Nsight Systems or set NSYS=/path/to/nsys" >&2
  exit 2
fi
if [ -z "${NPROC:-}" ]; then
  NPROC=$("${PY}" -c 'import torch; print(max(torch.cuda.device_count(), 1))' 2>/dev/null || echo 1)
fi
STEPS="${STEPS:-3,5}"
OUT="${OUT:-profiling/nsys-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "${OUT}"
job=(-m sysx.train profile.nvtx=true "profile.nsys_steps=[${STEPS}]" "$@")
"${PY}" "${job[@]:0:2}" --check --ranks "${NPROC}" "${job[@]:2}"  # pre-flight: one line and exit 2 if the job would fail
# options in --key=value form only: everything after them is the command nsys runs
"${PY}" -m sysx.launch --standalone --nproc_per_node="${NPROC}" --no-python \
  "${NSYS}" profile --output="${OUT}/sysx_%q{RANK}" --force-overwrite=true \
  --capture-range=cudaProfilerApi --capture-range-end=stop --trace=cuda,nvtx,osrt --sample=none \
  "${PY}" "${job[@]}"
echo "profiling/nsys.sh: reports in ${OUT}/ (sysx_<rank>.nsys-rep); open them with nsys-ui, or: nsys stats ${OUT}/sysx_0.nsys-rep"
