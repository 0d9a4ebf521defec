#!/usr/bin/env bash
# Compiles tpcomm's GPU code for AMD, for real, without an AMD GPU:
#   - every kernel (csrc/kernels/launch.cu) for gfx90a and gfx940 with Debian's hipcc (ROCm 5.2),
#   - the same kernels' device code for gfx942 with clang-19 (bitcode, then llc-19 to an object),
#   - the C core (csrc/core/*.c) against the HIP headers,
# all with -Wall -Werror, and checks that each output holds what it should.
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
hipcc -x hip --offload-arch=gfx90a --offload-arch=gfx940 -std=c++17 -O3 -Wall -Werror "${macros[@]}" \
  -c csrc/kernels/launch.cu -o "$out/launch_gfx90a_gfx940.o"
bundled=$(strings "$out/launch_gfx90a_gfx940.o")  # not piped into grep -q: pipefail would see SIGPIPE
for arch in gfx90a gfx940; do
  grep -q "amdgcn-amd-amdhsa--$arch" <<<"$bundled" || { echo "no $arch code object in the hipcc output" >&2; exit 1; }
done
echo "kernels: gfx90a, gfx940 (hipcc)"

clang-19 -x hip --offload-arch=gfx942 --cuda-device-only -fgpu-rdc -nogpulib --rocm-path=/usr -std=c++17 -O3 \
  -Wall -Werror "${macros[@]}" -c csrc/kernels/launch.cu -o "$out/launch_gfx942.bc"
"$llvm19/llc" -O3 -mtriple=amdgcn-amd-amdhsa -mcpu=gfx942 -filetype=obj "$out/launch_gfx942.bc" -o "$out/launch_gfx942.o"
symbols=$("$llvm19/llvm-readelf" -s "$out/launch_gfx942.o")
kernels=$(grep -c 'tpc_.*_kernel' <<<"$symbols" || true)
[ "$kernels" -ge 9 ] || { echo "expected the 9 kernels in the gfx942 object, found $kernels symbols" >&2; exit 1; }
echo "kernels: gfx942 (clang-19 + llc-19), $kernels kernel symbols"

for src in csrc/core/*.c; do
  gcc -std=c11 -O2 -fPIC -Wall -Wextra -Werror "${macros[@]}" -c "$src" -o "$out/$(basename "$src" .c).o"
done
echo "C core: $(cd csrc/core && echo *.c) against the HIP headers"
echo "ROCm compile: ok ($out)"
