#!/usr/bin/env bash
# The GPU runs of tpcomm, from the repository root of a machine with NVIDIA
# GPUs: builds in place, then runs the GPU test suite, the benchmark, the
# decode example, the fused op's routes and the host cost. Results go to
# RESULTS_DIR (default build/results, ignored by git): gpu_tests.log, the
# benchmark's JSON, its table (.txt) and its figures packed in plots.tar
# (untar them beside the JSON), tp_decode_<gpu>.json,
# add_rms_norm_routes_<gpu>.json and host_cost_<gpu>.json; the build log is
# build/build.log, shown on failure.
# Usage:
#   bash scripts/device_run.sh [tests|bench|tune|decode|routes|host|all] [pytest args...]
#   bash scripts/device_run.sh hf      (examples/hf_llama_tp.py over every GPU)
#   bash scripts/device_run.sh scale
#     benchmarks/scale_probe.cu: every kernel at 2..8 ranks, results checked
#     (ranks share the GPUs where there are fewer; timed at one GPU a rank),
#     then benchmarks/bandwidth_probe.cu (GPUs 0 and 1: the link's rates)
#   TPCOMM_TEST_WORLD="2 3" bash scripts/device_run.sh quant
#     tests/gpu/test_quantized_gpu.py with every rank on GPU 0 at each world
#     size given (default 2 3 4 8; one log per world size)
#   TPCOMM_TEST_WORLD="2 3" bash scripts/device_run.sh fp8
#     tests/gpu/test_fp8_norm_gpu.py (the fused norm's FP8 epilogues) with
#     every rank on GPU 0 at each world size given (default 2 3 4 8)
#   TPCOMM_TEST_WORLD="2 3" bash scripts/device_run.sh norm
#     both fused-norm GPU files (every pattern, tests/gpu/test_norm_patterns_gpu.py,
#     and the FP8 epilogues) the same way
#   bash scripts/device_run.sh fp8_phases
#     benchmarks/norm_fp8_probe.cu's phase build (-DNORM_FP8_PROBE_PHASES):
#     SM cycles to each mark of a row, with and without each FP8 epilogue
#     (norm_fp8_phases_<gpu>x1.txt)
#   bash scripts/device_run.sh fp8_local
#     benchmarks/norm_fp8_local.py (2 GPUs): the fused norm with each FP8
#     epilogue beside the kernel without it then a separate quantization
#     kernel (norm_fp8_local_<gpu>.json)
#   bash scripts/device_run.sh fp8_probe
#     benchmarks/norm_fp8_probe.cu (two ranks side by side on GPU 0: the
#     fused norm with each FP8 epilogue and without, results checked), then
#     benchmarks/norm_fp8_probe.py: the separate quantization kernel on the
#     same GPU, alone and after the kernel in one graph through the probe's
#     library (norm_fp8_probe_<gpu>x1.json, <gpu> the card the run had)
#   bash scripts/device_run.sh quant_local
#     benchmarks/quant_identity.cu on the GPU (the codecs' conversion
#     instructions give their software definition's bits), then
#     benchmarks/quant_local.cu: the quantized all-reduce's local work beside
#     a device-to-device copy (quant_local_<gpu>.txt)
#   bash scripts/device_run.sh accuracy
#     examples/quantized_accuracy.py: trains for 6 minutes (the weights kept
#     in build/, so a second call only evaluates), then held-out perplexity
#     and greedy agreement at TP2 and TP4 on GPU 0 (quantized_accuracy.json)
#   TPCOMM_TEST_WORLD=8 bash scripts/device_run.sh shared [pytest args...]
#     the GPU suite with every rank on GPU 0 (tests/multiproc.py: kernel
#     results at that world size on any machine; one log per world size);
#     TPCOMM_TEST_WORLD="3 5 8" runs it at each in turn after one build,
#     each world under its own TPCOMM_TEST_TIMEOUT_S
# BUILD=0 skips the in-place build, reusing the previous call's on this
# machine: several modes in one session, one build
#   bash scripts/device_run.sh fp8_probe && BUILD=0 bash scripts/device_run.sh fp8_phases
set -uo pipefail
export TPCOMM_TIMEOUT_S=${TPCOMM_TIMEOUT_S:-3} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
results=${RESULTS_DIR:-build/results}; mkdir -p "$results" build
what=${1:-all}; shift || true
# the suite, or the test files named first among the pytest args
suite=tests/gpu; case "${1:-}" in tests/*) suite=;; esac
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvidia-smi topo -m | head -3
start=$(date +%s)
if [ "${BUILD:-1}" != 0 ]; then
  TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . > build/build.log 2>&1 \
    || { tail -40 build/build.log; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
fi
ls python/tpcomm/_C*.so >/dev/null 2>&1 || { echo "no in-place build (python/tpcomm/_C*.so): run without BUILD=0"; exit 1; }
if [ "$what" = tests ] || [ "$what" = all ]; then
  # -s: the trust tests print the time to each error ("TIMING" lines)
  timeout ${TPCOMM_TEST_TIMEOUT_S:-420} python3 -m pytest -q -rs -s $suite "$@" 2>&1 | tee "$results/gpu_tests.log" \
    | grep -E "TIMING|passed|failed|Error|error|assert|FAIL|SKIP|^E " | tail -80
  echo "tests done: $(( $(date +%s) - start )) s"
fi
if [ "$what" = shared ]; then
  for world in ${TPCOMM_TEST_WORLD:-2}; do
    CUDA_VISIBLE_DEVICES=0 TPCOMM_SHARE_GPU=1 TPCOMM_TEST_WORLD=$world TPCOMM_TIMEOUT_S=10 \
      timeout ${TPCOMM_TEST_TIMEOUT_S:-420} python3 -m pytest -q -rs $suite "$@" 2>&1 \
      | tee "$results/gpu_tests_shared_world$world.log" | grep -E "passed|failed|^FAILED|SKIPPED" | tail -40
    echo "shared-GPU tests (world $world) done: $(( $(date +%s) - start )) s"
  done
fi
# result files name the card the run had and how many: h100x1, h200x2
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 | grep -oiE 'h[0-9]+' | head -1 | tr 'A-Z' 'a-z')x$(nvidia-smi -L | wc -l)
# one GPU test file with every rank on GPU 0, at each world size of TPCOMM_TEST_WORLD (default 2 3 4 8)
shared_file() {
  local file=$1 label=$2; shift 2
  for world in ${TPCOMM_TEST_WORLD:-2 3 4 8}; do
    # $file unquoted: one path, or several separated by spaces
    CUDA_VISIBLE_DEVICES=0 TPCOMM_SHARE_GPU=1 TPCOMM_TEST_WORLD=$world TPCOMM_TIMEOUT_S=10 \
      timeout ${TPCOMM_TEST_TIMEOUT_S:-540} python3 -m pytest -q -rs $file "$@" 2>&1 \
      | tee "$results/gpu_tests_${label}_world$world.log" | grep -E "passed|failed|^FAILED|^E |SKIPPED" | tail -30
    echo "$label tests (world $world) done: $(( $(date +%s) - start )) s"
  done
}
[ "$what" = quant ] && shared_file tests/gpu/test_quantized_gpu.py quantized "$@"
[ "$what" = fp8 ] && shared_file tests/gpu/test_fp8_norm_gpu.py fp8 "$@"
[ "$what" = norm ] && shared_file "tests/gpu/test_norm_patterns_gpu.py tests/gpu/test_fp8_norm_gpu.py" norm "$@"
# the FP8 probe's build: the timed and library builds (fp8_probe), the phase build (fp8_phases)
probe="nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/norm_fp8_probe.cu csrc/core/limits.c"
if [ "$what" = fp8_phases ]; then
  $probe -DNORM_FP8_PROBE_PHASES -o build/norm_fp8_probe_phases || exit 1
  CUDA_VISIBLE_DEVICES=0 timeout 300 build/norm_fp8_probe_phases 2 2>&1 | tee "$results/norm_fp8_phases_${gpus%x*}x1.txt" \
    | tail -30
fi
if [ "$what" = fp8_local ]; then
  timeout 540 python3 benchmarks/norm_fp8_local.py --out "$results/norm_fp8_local_$gpus.json" 2>&1 \
    | tail -20
fi
if [ "$what" = fp8_probe ]; then
  card=${gpus%x*}x1
  $probe -o build/norm_fp8_probe && $probe -shared -Xcompiler -fPIC -DNORM_FP8_PROBE_LIBRARY \
    -o build/libnorm_fp8_probe.so || exit 1
  CUDA_VISIBLE_DEVICES=0 timeout 540 python3 benchmarks/norm_fp8_probe.py --probe build/norm_fp8_probe \
    --library build/libnorm_fp8_probe.so --out "$results/norm_fp8_probe_$card.json" 2>&1 | grep -v Warning | tail -45
fi
if [ "$what" = quant_local ]; then
  # first the codecs' instructions against their software definition (benchmarks/quant_identity.cu)
  nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/quant_identity.cu -o build/quant_identity \
    && CUDA_VISIBLE_DEVICES=0 timeout 120 build/quant_identity device | tee "$results/quant_identity_$gpus.txt"
  nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/quant_local.cu -o build/quant_local \
    && CUDA_VISIBLE_DEVICES=0 timeout 120 build/quant_local | tee "$results/quant_local_$gpus.txt"
fi
if [ "$what" = accuracy ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 540 python3 examples/quantized_accuracy.py --train-minutes 6 \
    --checkpoint build/quantized_accuracy_model.pt --out "$results/quantized_accuracy.json" 2>&1 | tail -40
fi
if [ "$what" = scale ]; then
  nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc benchmarks/scale_probe.cu -o build/scale_probe || exit 1
  for n in 2 3 4 5 6 7 8; do
    timeout 120 build/scale_probe "$n" 2>&1 | tee -a "$results/scale_probe_$gpus.txt" | tail -3 || echo "scale_probe $n failed"
  done
  echo "scale probe done: $(( $(date +%s) - start )) s"
  nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/bandwidth_probe.cu -o build/bandwidth_probe \
    && timeout 150 build/bandwidth_probe > "$results/bandwidth_probe_$gpus.txt" 2>&1
  grep -E "copy-eng|push4 +132" "$results/bandwidth_probe_$gpus.txt"
  echo "bandwidth probe done: $(( $(date +%s) - start )) s"
fi
if [ "$what" = tune ]; then
  # one file per GPU model: a run at another world size extends it (copy the file in first)
  timeout 330 python3 -m tpcomm.tune --out "$results/h200.json" 2>&1 | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  bench=build/bench; mkdir -p "$bench"
  timeout 330 python3 -m tpcomm.bench --out "$bench/$gpus.json" --deadline-s 250 2>&1 | tee "$results/$gpus.txt" | tail -120
  cp "$bench/$gpus.json" "$results/" 2>/dev/null
  (cd "$bench" && tar -cf "$results/plots.tar" *.png) 2>/dev/null
  echo "bench done: $(( $(date +%s) - start )) s"
fi
if [ "$what" = decode ] || [ "$what" = all ]; then
  # tpcomm_fused: the fused all-reduce + add + RMSNorm kernel beside the rest
  timeout 200 python3 examples/tp_decode.py --backends none,none_fused,nccl,tpcomm,tpcomm_fused \
    --out "$results/tp_decode_$gpus.json" 2>&1 | grep -E "ms per step|wrote|Error|error" | tail -12
  echo "decode done: $(( $(date +%s) - start )) s"
fi
if [ "$what" = hf ]; then
  # transformers' Llama with its TP plan over every GPU: nccl / tpcomm, eager and compiled
  timeout 400 torchrun --standalone --nproc-per-node="$(nvidia-smi -L | wc -l)" examples/hf_llama_tp.py \
    --out "$results/hf_llama_tp_$gpus.json" 2>&1 | grep -E "s_per_forward|agree|wrote|Error|error" | tail -20
fi
if [ "$what" = routes ] || [ "$what" = all ]; then
  timeout 120 python3 benchmarks/add_rms_norm_routes.py --out "$results/add_rms_norm_routes_$gpus.json" 2>&1 \
    | grep -v Warning | tail -8
fi
if [ "$what" = host ] || [ "$what" = all ]; then
  timeout 90 python3 benchmarks/host_cost.py --out "$results/host_cost_$gpus.json" 2>&1 | tail -12
fi
