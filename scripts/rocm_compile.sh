#!/usr/bin/env bash
# Compiles tpcomm's GPU code for AMD, for real, without an AMD GPU:
#   - every kernel (csrc/kernels/launch.cu) for gfx90a (CDNA2) with Debian's hipcc (ROCm 5.2),
#   - the same kernels' device code for gfx942 (CDNA3) with clang-19 (bitcode, then llc-19 to an object),
#   - the C core (csrc/core/*.c) against the HIP headers,
# all with -Wall -Werror, and checks that each output holds what it should. The two kernel
# compiles run side by side (each uses one core).
# Needs: apt-get install hipcc libamdhip64-dev rocm-device-libs clang-19 (`--install` does it).
# Usage: bash scripts/rocm_compile.sh [--install] [OUTDIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "${1:-}" = --install ]; then
  shift
  if ! command -v hipcc >/dev/null || ! command -v clang-19 >/dev/null; then
    apt-get update -qq && apt-get install -y -qq hipcc libamdhip64-dev rocm-device-libs clang-19 >/dev/null
  fi
fi
out=${1:-$(mktemp -d /tmp/tpcomm-rocm.XXXX)}
mkdir -p "$out"
macros=(-D__HIP_PLATFORM_AMD__=1 -DUSE_ROCM=1)
llvm19=/usr/lib/llvm-19/bin

echo "hipcc: $(hipcc --version 2>/dev/null | grep -m1 -i 'HIP version' || true)"
hipcc -x hip --offload-arch=gfx90a -std=c++17 -O3 -Wall -Werror "${macros[@]}" \
  -c csrc/kernels/launch.cu -o "$out/launch_gfx90a.o" > "$out/hipcc.log" 2>&1 &
hipcc_job=$!
{ clang-19 -x hip --offload-arch=gfx942 --cuda-device-only -fgpu-rdc -nogpulib --rocm-path=/usr -std=c++17 -O3 \
    -Wall -Werror "${macros[@]}" -c csrc/kernels/launch.cu -o "$out/launch_gfx942.bc" \
  && "$llvm19/llc" -O3 -mtriple=amdgcn-amd-amdhsa -mcpu=gfx942 -filetype=obj "$out/launch_gfx942.bc" \
       -o "$out/launch_gfx942.o"; } > "$out/clang19.log" 2>&1 &
clang_job=$!
failed=0
wait "$hipcc_job" || { cat "$out/hipcc.log" >&2; echo "hipcc failed for gfx90a" >&2; failed=1; }
wait "$clang_job" || { cat "$out/clang19.log" >&2; echo "clang-19 failed for gfx942" >&2; failed=1; }
[ "$failed" = 0 ] || exit 1

bundled=$(strings "$out/launch_gfx90a.o")  # not piped into grep -q: pipefail would see SIGPIPE
grep -q "amdgcn-amd-amdhsa--gfx90a" <<<"$bundled" || { echo "no gfx90a code object in the hipcc output" >&2; exit 1; }
echo "kernels: gfx90a (hipcc)"
symbols=$("$llvm19/llvm-readelf" -s "$out/launch_gfx942.o")
kernels=$(grep -c 'tpc_.*_kernel' <<<"$symbols" || true)
[ "$kernels" -ge 9 ] || { echo "expected the 9 kernels in the gfx942 object, found $kernels symbols" >&2; exit 1; }
echo "kernels: gfx942 (clang-19 + llc-19), $kernels kernel symbols"

for src in csrc/core/*.c; do
  gcc -std=c11 -O2 -fPIC -Wall -Wextra -Werror "${macros[@]}" -c "$src" -o "$out/$(basename "$src" .c).o"
done
echo "C core: $(cd csrc/core && echo *.c) against the HIP headers"
echo "ROCm compile: ok ($out)"
