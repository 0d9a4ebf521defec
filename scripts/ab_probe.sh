#!/usr/bin/env bash
# Interleaved A/B of the fused norm's kernels on one GPU: benchmarks/norm_fp8_probe.cu
# built from a baseline's sources and from the working tree's, timed and phase builds,
# run in alternating rounds (base, new, base, new, ...) so that drift of the machine
# hits both alike. Prints, per shape and epilogue, each build's time (minimum over the
# rounds) and its cost against the same build's kernel without an epilogue, then the
# codes' phase (SM cycles from mark 3 to mark 4, mean of every rank and round).
#
#   mkdir -p .ab && git archive <rev> csrc benchmarks -o .ab/base.tar
#   bash scripts/ab_probe.sh .ab/base.tar [rounds] [hidden ...]   (default 2 rounds, 4096 8192 16384)
# Each round's output is kept in AB_DIR (default build/ab_probe). BASE.tar "-" runs the
# builds already in AB_DIR (timed_base, phases_base, timed_new, phases_new: made on a
# machine without a GPU, by the same nvcc line, and carried) instead of building.
set -u
base_tar=${1:?usage: ab_probe.sh BASE.tar [rounds] [hidden ...]}
rounds=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
hidden=("$@")
[ ${#hidden[@]} -gt 0 ] || hidden=(4096 8192 16384)
dir=${AB_DIR:-build/ab_probe}
build() {  # build SOURCE_ROOT NAME: the timed and phase builds, in parallel
  local probe="nvcc -O3 -std=c++17 -arch=sm_90 -I$1/csrc $1/benchmarks/norm_fp8_probe.cu $1/csrc/core/limits.c"
  $probe -o "$dir/timed_$2" > "$dir/build_timed_$2.log" 2>&1 &
  $probe -DNORM_FP8_PROBE_PHASES -o "$dir/phases_$2" > "$dir/build_phases_$2.log" 2>&1 &
}
if [ "$base_tar" != - ]; then
  rm -rf "$dir" && mkdir -p "$dir/base"
  tar -xf "$base_tar" -C "$dir/base" || exit 1
  build "$dir/base" base
  build . new
  wait
fi
for b in timed_base phases_base timed_new phases_new; do
  [ -x "$dir/$b" ] || { tail -20 "$dir/build_$b.log"; exit 1; }
done
for round in $(seq 1 "$rounds"); do
  for v in base new; do
    for kind in timed phases; do
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 300 "$dir/${kind}_$v" 2 "${hidden[@]}" \
        > "$dir/${kind}_${v}_$round.txt" 2>&1 || { tail -20 "$dir/${kind}_${v}_$round.txt"; exit 1; }
    done
  done
done
python3 - "$dir" <<'PY'
import collections, glob, sys
d = sys.argv[1]
us, codes = {}, {}
for v in ("base", "new"):
    us[v] = collections.defaultdict(lambda: float("inf"))
    codes[v] = collections.defaultdict(list)
    for f in glob.glob(f"{d}/timed_{v}_*.txt"):  # tokens hidden epilogue us
        for p in (line.split() for line in open(f)):
            if len(p) == 4 and p[0].isdigit():
                k = (int(p[0]), int(p[1]), p[2])
                us[v][k] = min(us[v][k], float(p[3]))
    for f in glob.glob(f"{d}/phases_{v}_*.txt"):  # tokens hidden epilogue rank calls m0 .. m6
        for p in (line.split() for line in open(f)):
            if len(p) == 12 and p[0].isdigit():
                codes[v][(int(p[0]), int(p[1]), p[2])].append(int(p[9]) - int(p[8]))
print("tokens hidden epilogue        | base us (cost) codes | new us (cost) codes")
for k in sorted(us["new"]):
    row = f"{k[0]:6d} {k[1]:6d} {k[2]:16s}"
    for v in ("base", "new"):
        t, none = us[v][k], us[v][(k[0], k[1], "none")]
        c = codes[v][k]
        row += f" | {t:8.3f} ({100 * (t / none - 1):+5.1f} %) {sum(c) / len(c) if c else float('nan'):6.0f}"
    print(row)
PY
