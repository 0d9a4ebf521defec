#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, synccheck and initcheck over every
# tpcomm kernel and band (scripts/sanitize_ranks.py lists the cases: all_reduce
# packet/line/bulk, all_gather packet flat and general/line/bulk,
# reduce_scatter packet/bulk in both output dtypes, the fused norm family's
# patterns spread and in place), on one GPU: the ranks share it, rank 0 runs under the tool and
# the others plain. World 2 runs the one-shot bulk all-reduce, world 3 the
# two-shot ones and the general (n > 2) paths of the rest; the streamed
# reduce-scatter and all-gather run at both.
#
# Usage (repository root, one GPU; needs compute-sanitizer and a built torch):
#   bash scripts/sanitize.sh [LOG_DIR]
#   TOOLS="racecheck" WORLDS="2" bash scripts/sanitize.sh /tmp/san
#   WORLDS=3 BUILD=0 bash scripts/sanitize.sh /tmp/san   (a second call, reusing the build)
# Writes LOG_DIR/<tool>-w<world>.log (the tool's report) and
# <tool>-w<world>-rank<r>.out (each rank's output), then judges every report
# with scripts/sanitize_expect.py: 0 errors, except racecheck's reports of
# the streamed kernels' push-count handoff (a release against its acquire,
# which racecheck does not model; csrc/kernels/stream.cuh). racecheck runs in
# hazard mode, every hazard reported. Exits 1 on anything else, on a wrong
# result, or on a run that does not finish within RUN_TIMEOUT_S.
# ONLY="bulk" runs only the cases whose name holds that text
# (scripts/sanitize_ranks.py --only). With racecheck, the reproduction
# benchmarks/racecheck_stream_start.cu runs first, both ways of zeroing the
# counts: the kernels' way must draw only handoff reports; the count of
# reports on the other way is printed beside it (docs/testing.md).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
logs=${1:-/tmp/tpcomm-sanitize}
mkdir -p "$logs"
tools=${TOOLS:-memcheck racecheck synccheck initcheck}
worlds=${WORLDS:-2 3}
run_timeout=${RUN_TIMEOUT_S:-150}
sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
[ -x "$sanitizer" ] || { echo "compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2; exit 1; }
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$(date +%s)

# Line information lets a report name its source line; the machine code is
# the same with or without it. BUILD=0 reuses the in-place build of an
# earlier call.
if [ "${BUILD:-1}" != 0 ]; then
  NVCC_APPEND_FLAGS="-lineinfo" TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
    python3 setup.py -q build_ext --inplace --force >"$logs/build.log" 2>&1 || { tail -30 "$logs/build.log"; exit 1; }
  echo "build (with -lineinfo): $(( $(date +%s) - start )) s"
fi
# The machine code the logs' program counters point into (sanitize_expect.py
# finds the count releases in it: ptxas may tag one with another line).
cuobjdump=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null \
  || python3 -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))')
"$cuobjdump" -sass python/tpcomm/_C*.so >"$logs/kernels.sass" || { echo "cuobjdump failed on the build" >&2; exit 1; }

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

only=()
[ -n "${ONLY:-}" ] && only=(--only "$ONLY")

status=0
if [[ " $tools " == *" racecheck "* ]]; then
  nvcc -O3 -std=c++17 -arch=sm_90 -lineinfo -Icsrc benchmarks/racecheck_stream_start.cu -o "$logs/racecheck_stream_start" \
    || exit 1
  "$cuobjdump" -sass "$logs/racecheck_stream_start" >"$logs/racecheck_stream_start.sass" || exit 1
  for way in control data; do
    timeout -k 10 "$run_timeout" "$sanitizer" --tool racecheck --racecheck-report hazard --print-limit 0 \
      --log-file "$logs/racecheck-start-$way.log" "$logs/racecheck_stream_start" "$way" >"$logs/racecheck-start-$way.out" 2>&1
    rc=$?
    verdict=$(python3 scripts/sanitize_expect.py racecheck "$logs/racecheck-start-$way.log" "$logs/racecheck_stream_start.sass")
    ok=$?
    printf '%-16s %s\n' "start ($way)" "$(head -1 <<<"$verdict")"
    if [ "$way" = control ] && { [ "$rc" != 0 ] || [ "$ok" != 0 ]; }; then
      status=1
      tail -n +2 <<<"$verdict" | head -20
      tail -3 "$logs/racecheck-start-$way.out"
    fi
  done
fi
for world in $worlds; do
  for tool in $tools; do
    t0=$(date +%s)
    name="$tool-w$world"
    flags=(--tool "$tool" --log-file "$logs/$name.log" --print-limit 0 --report-api-errors no)
    # initcheck follows every write to know what is initialised, torch's too:
    # it checks every kernel; the others only tpcomm's (named tpc_*).
    [ "$tool" = initcheck ] || flags+=(--kernel-name kns=tpc_)
    [ "$tool" = memcheck ] && flags+=(--leak-check no)
    [ "$tool" = racecheck ] && flags+=(--racecheck-report hazard)
    port=$(free_port)
    peers=()
    for ((r = 1; r < world; ++r)); do
      timeout -k 10 "$run_timeout" python3 scripts/sanitize_ranks.py --rank "$r" --world "$world" --port "$port" "${only[@]}" \
        >"$logs/$name-rank$r.out" 2>&1 &
      peers+=($!)
    done
    timeout -k 10 "$run_timeout" "$sanitizer" "${flags[@]}" \
      python3 scripts/sanitize_ranks.py --rank 0 --world "$world" --port "$port" "${only[@]}" >"$logs/$name-rank0.out" 2>&1
    rc=$?
    for pid in "${peers[@]}"; do
      wait "$pid" || rc=$((rc ? rc : 1))
    done
    verdict=$(python3 scripts/sanitize_expect.py "$tool" "$logs/$name.log" "$logs/kernels.sass") || rc=$((rc ? rc : 1))
    printf '%-16s %4d s  %s\n' "$name" $(( $(date +%s) - t0 )) "$(head -1 <<<"$verdict")"
    if [ "$rc" != 0 ]; then
      status=1
      tail -n +2 <<<"$verdict"
      for f in "$logs/$name"-rank*.out; do
        grep -E "FAILED|Error|error|Traceback" "$f" | tail -5 | sed "s|^|  $(basename "$f"): |"
      done
      [ "$rc" = 124 ] && echo "  $name: still running after $run_timeout s (killed)"
    fi
  done
done
echo "sanitize: $(( $(date +%s) - start )) s, logs in $logs: $([ $status = 0 ] && echo clean || echo FAILED)"
exit $status
