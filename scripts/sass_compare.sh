#!/usr/bin/env bash
# Compares the sm_90 machine code of every kernel in csrc/kernels/launch.cu
# between a base commit and the working tree, function by function, so that
# a change meant to alter only the shape of the source (names, helpers,
# comments) is shown to leave the code the GPU runs as it was.
#
# Both trees are compiled with the flags setup.py gives nvcc; cuobjdump -sass
# output is cut into functions and normalised (addresses, encodings, comments
# and the function's own name dropped, so a renamed function compares by its
# code alone). Prints one line per kernel: "same", "differs" (with a diff of
# up to 40 lines under the log directory) or "only in base"/"only in tree",
# then its resources as ptxas reports them, base -> tree: "<registers>r
# <stack frame>+<spill stores and loads>B" (bytes of local memory).
#
# Usage: bash scripts/sass_compare.sh [BASE_COMMIT] [LOG_DIR]
#   BASE_COMMIT defaults to the merge base with main; LOG_DIR to a new /tmp dir.
# Exit status: 0 when every function is the same, 1 when any differs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
base=${1:-$(git merge-base HEAD main 2>/dev/null || git rev-parse HEAD)}
logs=${2:-$(mktemp -d /tmp/tpcomm-sass.XXXX)}
mkdir -p "$logs"
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || true)}
if [ -z "$cuobjdump" ]; then
  # torch's CUDA wheels ship none; triton's does
  cuobjdump=$(python3 -c 'import triton, os; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))')
fi
# what torch's BuildExtension passes nvcc for launch.cu (setup.py), for sm_90
flags=(-O3 -std=c++17 -arch=sm_90 -cubin -DUSE_CUDA -DTORCH_TARGET_VERSION=0x020a000000000000
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
       -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr)

base_tree="$logs/base-src"
rm -rf "$base_tree" && mkdir -p "$base_tree"
git archive "$base" csrc | tar -x -C "$base_tree"

# One normalised listing per function: "<dir>/<mangled name>.sass".
split_sass() {  # cubin outdir
  mkdir -p "$2"
  "$cuobjdump" -sass "$1" 2>/dev/null | awk -v out="$2" '
    /^[ \t]*Function : / { name = $3; file = out "/" name ".sass"; next }
    name != "" && /^[ \t]*\/\*[0-9a-f][0-9a-f][0-9a-f][0-9a-f]+\*\// {
      line = $0
      sub(/^[ \t]*\/\*[0-9a-f]+\*\/[ \t]*/, "", line)   # the address
      sub(/[ \t]*\/\*[^*]*\*\/[ \t]*$/, "", line)         # the encoding comment
      sub(/[ \t]*;[ \t]*$/, "", line)
      gsub(/[ \t]+/, " ", line)
      # a call names its target by offset, which moves when another function
      # changes size: the callee is compared as a function of its own
      if (line ~ /CALL/) gsub(/0x[0-9a-f]+/, "TARGET", line)
      print line > file
    }'
}

# ptxas -v's report, one line per function: "<mangled name> <registers> <stack> <spill stores> <spill loads>"
resources() {  # ptxas log, out file
  awk '/Function properties for / { name = $NF; next }
       name != "" && /bytes stack frame/ { stack[name] = $1; st[name] = $5; ld[name] = $9; next }
       /Used [0-9]+ registers/ && name != "" { for (i = 1; i < NF; ++i) if ($(i + 1) ~ /^registers/) regs[name] = $i }
       END { for (n in regs) print n, regs[n], stack[n], st[n], ld[n] }' "$1" >"$2"
}

"$nvcc" "${flags[@]}" -Xptxas -v -o "$logs/base.cubin" "$base_tree/csrc/kernels/launch.cu" 2>"$logs/base.ptxas"
"$nvcc" "${flags[@]}" -Xptxas -v -o "$logs/tree.cubin" csrc/kernels/launch.cu 2>"$logs/tree.ptxas"
resources "$logs/base.ptxas" "$logs/base.resources"
resources "$logs/tree.ptxas" "$logs/tree.resources"
split_sass "$logs/base.cubin" "$logs/base"
split_sass "$logs/tree.cubin" "$logs/tree"

# "<registers>r <stack>+<spills>B" of a function in a tree's report, "-" where it has none
usage() {  # resources file, mangled name
  awk -v n="$2" '$1 == n { printf "%sr %s+%sB", $2, $3, $4 + $5; found = 1 } END { if (!found) printf "-" }' "$1"
}

status=0
printf '%-9s %-26s %s\n' result "resources base -> tree" "kernel (demangled)"
for f in $( (ls "$logs/base"; ls "$logs/tree") | sort -u); do
  name=$(echo "${f%.sass}" | c++filt)
  name=$(printf '%-26s %s' "$(usage "$logs/base.resources" "${f%.sass}") -> $(usage "$logs/tree.resources" "${f%.sass}")" "$name")
  if [ ! -f "$logs/base/$f" ]; then
    printf '%-9s %s (%s instructions)\n' "only-tree" "$name" "$(wc -l <"$logs/tree/$f")"; status=1; continue
  fi
  if [ ! -f "$logs/tree/$f" ]; then
    printf '%-9s %s (%s instructions)\n' "only-base" "$name" "$(wc -l <"$logs/base/$f")"; status=1; continue
  fi
  if diff -q "$logs/base/$f" "$logs/tree/$f" >/dev/null; then
    printf '%-9s %s\n' same "$name"
  else
    printf '%-9s %s (%s vs %s instructions; %s)\n' differs "$name" "$(wc -l <"$logs/base/$f")" \
      "$(wc -l <"$logs/tree/$f")" "$logs/${f%.sass}.diff"
    diff "$logs/base/$f" "$logs/tree/$f" | head -40 >"$logs/${f%.sass}.diff" || true
    status=1
  fi
done
echo "base $base; listings and diffs in $logs"
exit $status
