#!/usr/bin/env bash
# bench/gpu.sh: bench/gpu.py on a GPU machine, everything it writes under $OUT (the device tool
# brings back what is there): results_gpu.json, README.md (bench/README.md with the GPU table),
# gpu_tests.xml, log.txt, nvidia-smi.txt. Installs nothing: the machine's python3 has torch,
# numpy, safetensors, h5py, click, pytest and hypothesis. See bench/README.md, "On a GPU".
#
#   bash bench/gpu.sh                               # every section, a 330 s budget, killed at 390 s
#   GPU_BUDGET_S=200 bash bench/gpu.sh --sections overhead:124M,gpu_tests   # a rerun of some
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/nanreplay-gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
unset CUBLAS_WORKSPACE_CONFIG  # as in a user's shell: what the replay does about it is measured
cp bench/README.md "$out/README.md"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
timeout -k 20 "${GPU_TIMEOUT_S:-390}" python3 bench/gpu.py --budget-s "${GPU_BUDGET_S:-330}" \
    --out "$out/results_gpu.json" --readme "$out/README.md" "$@" 2>&1 | tee "$out/log.txt"
status=${PIPESTATUS[0]}
echo "gpu.sh: bench/gpu.py exited $status; results in $out"
exit "$status"
