#!/usr/bin/env bash
# One device-machine call: build, GPU test suite, benchmark. Logs under $OUT.
# Usage (on the device machine, repo root): bash scripts/device_run.sh [tests|bench|all] [pytest args...]
set -uo pipefail
export TPCOMM_TIMEOUT_S=${TPCOMM_TIMEOUT_S:-3} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tpcomm-out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
{ nvidia-smi --query-gpu=name,driver_version --format=csv; nvidia-smi topo -m; } > "$OUT/machine.txt" 2>&1
start=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 420 python3 -m pytest -q -rs tests/gpu "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -60
  echo "tests done: $(( $(date +%s) - start )) s"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 400 python3 -m tpcomm.bench --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -80
  echo "bench done: $(( $(date +%s) - start )) s"
fi
