#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, synccheck and initcheck over every
# tpcomm kernel and band (scripts/sanitize_ranks.py lists the cases: all_reduce
# packet/line/bulk, all_gather packet flat and general/line/bulk,
# reduce_scatter packet/bulk in both output dtypes, every instantiation of
# the streamed all-reduce and reduce-scatter (by dtype and output), the
# fused norm family's RMSNorm and LayerNorm patterns spread and in place, with biases and residual
# scales, and its FP8 epilogues), on one GPU: the ranks share it, rank 0 runs
# under the tool and the others plain. World 2 runs the one-shot bulk all-reduce, world 3 the
# two-shot ones and the general (n > 2) paths of the rest; the streamed
# reduce-scatter and all-gather run at both.
#
# Usage (repository root, one GPU; needs compute-sanitizer and a built torch):
#   bash scripts/sanitize.sh [LOG_DIR]
#   TOOLS="racecheck" WORLDS="2" bash scripts/sanitize.sh /tmp/san
#   WORLDS=3 BUILD=0 bash scripts/sanitize.sh /tmp/san   (a second call, reusing the build)
# Writes LOG_DIR/<tool>-w<world>.log (the tool's report) and
# <tool>-w<world>-rank<r>.out (each rank's output), then judges every log
# with scripts/sanitize_expect.py: 0 errors, except racecheck's reports of
# the streamed kernels' push-count handoff (a count's release against its
# acquire, which racecheck does not model; csrc/kernels/stream.cuh), found by
# their program counters in the SASS of the kernel they ran in. A report does
# not name that kernel, so racecheck (hazard mode, every hazard reported)
# runs once for each kernel whose SASS holds a count release, filtered to it
# alone (scripts/sanitize_filters.sh; logs racecheck-w<world>-<mangled
# name>.log), on the cases that launch the streamed kernels (HANDOFF_CASES,
# default "bulk quant", each a text of sanitize_ranks.py --only), and once
# over every other tpc_ kernel and all cases (racecheck-w<world>-rest.log),
# where no report is accepted. Exits 1 on anything else, on a wrong result,
# or on a run that does not finish within RUN_TIMEOUT_S.
# ONLY="bulk" runs only the cases whose name holds that text
# (scripts/sanitize_ranks.py --only), in every run. HANDOFF_KERNELS, an
# extended regular expression, keeps the per-kernel racecheck runs of only
# the handoff kernels whose mangled name matches it ("none" keeps none: the
# fused norm's cases launch no handoff kernel). With racecheck, the
# reproduction benchmarks/racecheck_stream_start.cu runs first, both ways of
# zeroing the counts, each filtered to its kernel and judged against its own
# SASS: the kernels' way must draw only handoff reports; the count of reports
# on the other way is printed beside it (docs/testing.md).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/sanitize_filters.sh
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
# The machine code the logs' program counters point into: sanitize_expect.py
# finds the count releases and the strong loads in the one kernel a
# racecheck run is filtered to.
cuobjdump=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null \
  || python3 -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))')
"$cuobjdump" -sass python/tpcomm/_C*.so >"$logs/kernels.sass" || { echo "cuobjdump failed on the build" >&2; exit 1; }

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

only=()
[ -n "${ONLY:-}" ] && only=(--only "$ONLY")
handoff_cases=("${only[@]}")
if [ -z "${ONLY:-}" ]; then
  for c in ${HANDOFF_CASES:-bulk quant}; do handoff_cases+=(--only "$c"); done
fi

status=0
# run_ranks NAME WORLD TOOL: rank 0 under the tool with the options in
# `flags`, the other ranks plain, all on the cases `cases` (sanitize_ranks.py
# options); then sanitize_expect.py judges the log with the arguments `judge`.
run_ranks() {
  local name=$1 world=$2 tool=$3 t0 port rc r pid f verdict peers=()
  t0=$(date +%s)
  port=$(free_port)
  for ((r = 1; r < world; ++r)); do
    timeout -k 10 "$run_timeout" python3 scripts/sanitize_ranks.py --rank "$r" --world "$world" --port "$port" \
      "${cases[@]}" >"$logs/$name-rank$r.out" 2>&1 &
    peers+=($!)
  done
  timeout -k 10 "$run_timeout" "$sanitizer" --tool "$tool" --log-file "$logs/$name.log" --print-limit 0 \
    --report-api-errors no "${flags[@]}" \
    python3 scripts/sanitize_ranks.py --rank 0 --world "$world" --port "$port" "${cases[@]}" \
    >"$logs/$name-rank0.out" 2>&1
  rc=$?
  for pid in "${peers[@]}"; do
    wait "$pid" || rc=$((rc ? rc : 1))
  done
  verdict=$(python3 scripts/sanitize_expect.py "$tool" "$logs/$name.log" "${judge[@]}") || rc=$((rc ? rc : 1))
  # A handoff kernel that runs draws handoff reports every time: none means
  # its filter matched nothing, and the kernel went unchecked.
  if [ -n "${must_report:-}" ] && grep -q "no report" <<<"$verdict"; then
    verdict+=$'\n'"  $must_report launches at world $world, yet its run drew no report: the filter matched nothing"
    rc=$((rc ? rc : 1))
  fi
  printf '%-16s %4d s  %s\n' "$tool-w$world" $(( $(date +%s) - t0 )) "$(head -1 <<<"$verdict")"
  if [ "$rc" != 0 ]; then
    status=1
    tail -n +2 <<<"$verdict"
    for f in "$logs/$name"-rank*.out; do
      grep -E "FAILED|Error|error|Traceback" "$f" | tail -5 | sed "s|^|  $(basename "$f"): |"
    done
    [ "$rc" = 124 ] && echo "  $name: still running after $run_timeout s (killed)"
  fi
}

if [[ " $tools " == *" racecheck "* ]]; then
  kernels=$(handoff_kernels "$logs/kernels.sass") || exit 1
  mapfile -t handoff <<<"$kernels"
  # the runs of one kernel each; the rest run still leaves out every handoff kernel
  if [ "${HANDOFF_KERNELS:-}" = none ]; then
    runs=()
  else
    mapfile -t runs < <(grep -E -- "${HANDOFF_KERNELS:-.}" <<<"$kernels")
  fi
  probe="$logs/racecheck_stream_start"
  nvcc -O3 -std=c++17 -arch=sm_90 -lineinfo -Icsrc benchmarks/racecheck_stream_start.cu -o "$probe" || exit 1
  "$cuobjdump" -sass "$probe" >"$probe.sass" || exit 1
  probe_kernels=$(handoff_kernels "$probe.sass") || exit 1
  for way in control data; do
    # probe_stream_start<DATA_ZEROES>: 0 the control warp's way, 1 the data threads'
    kernel=$(grep -E "^_Z[0-9]+probe_stream_startILi$([ "$way" = data ] && echo 1 || echo 0)E" <<<"$probe_kernels")
    if [ -z "$kernel" ] || [ "$(wc -l <<<"$kernel")" != 1 ]; then
      echo "start ($way): not one probe_stream_start kernel among $probe.sass's: $probe_kernels" >&2
      exit 1
    fi
    kernel_filter "$kernel"
    timeout -k 10 "$run_timeout" "$sanitizer" --tool racecheck --racecheck-report hazard --print-limit 0 \
      "${filter[@]}" --log-file "$logs/racecheck-start-$way.log" "$probe" "$way" >"$logs/racecheck-start-$way.out" 2>&1
    rc=$?
    verdict=$(python3 scripts/sanitize_expect.py racecheck "$logs/racecheck-start-$way.log" "$probe.sass" \
      --kernel "$kernel")
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
    cases=("${only[@]}")
    judge=("$logs/kernels.sass")
    case $tool in
      # initcheck follows every write to know what is initialised, torch's
      # too: it checks every kernel; the others only tpcomm's (named tpc_*).
      initcheck) flags=() ;;
      memcheck) flags=(--kernel-name kns=tpc_ --leak-check no) ;;
      synccheck) flags=(--kernel-name kns=tpc_) ;;
      racecheck)
        for kernel in "${runs[@]}"; do
          kernel_filter "$kernel"
          # limits.c: the one-shot stream runs at two ranks only, the streamed
          # two-shot at three or more (each instantiation: the patterns match
          # its mangled name); ONLY may leave any kernel out
          case ${ONLY:+only}:$world:$kernel in
            only:* | :2:*tpc_all_reduce_bulk_kernel* | :[3-8]:*tpc_all_reduce_stream_kernel*) must_report= ;;
            *) must_report=$kernel ;;
          esac
          flags=(--racecheck-report hazard "${filter[@]}")
          cases=("${handoff_cases[@]}")
          judge=("$logs/kernels.sass" --kernel "$kernel")
          run_ranks "racecheck-w$world-$kernel" "$world" racecheck
        done
        must_report=
        rest_filter "${handoff[@]}"
        flags=(--racecheck-report hazard "${filter[@]}")
        cases=("${only[@]}")
        judge=("$logs/kernels.sass")
        run_ranks "racecheck-w$world-rest" "$world" racecheck
        continue ;;
    esac
    run_ranks "$tool-w$world" "$world" "$tool"
  done
done
echo "sanitize: $(( $(date +%s) - start )) s, logs in $logs: $([ $status = 0 ] && echo clean || echo FAILED)"
exit $status
