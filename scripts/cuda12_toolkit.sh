#!/usr/bin/env bash
# Assembles a CUDA 12.8 toolkit for building tpcomm's CUDA 12 wheel with clang,
# from NVIDIA's PyPI wheels (there is no CUDA 12 nvcc on PyPI or in Debian):
#   include/         cuda_runtime (headers), cuda_nvcc (crt/ headers), cuda_cccl (nv/, cuda/)
#   bin/ptxas        from nvidia-cuda-nvcc-cu12
#   bin/fatbinary    scripts/cuda12/fatbinary, on libnvfatbin (nvidia-nvfatbin-cu12)
#   nvvm/libdevice/  from nvidia-cuda-nvcc-cu12
#   lib64/           libcudart.so.12 (+ libcudart.so for the linker), libnvfatbin.so.12
# clang-19 then compiles the kernels against it:
#   CUDA_HOME=DIR TPCOMM_CUDA_CLANG=clang-19 pip wheel --no-build-isolation .   (in a torch 2.10 venv)
# Usage: bash scripts/cuda12_toolkit.sh DIR [PYTHON]   (PYTHON: one with pip; default python3)
set -euo pipefail
dir=${1:?usage: cuda12_toolkit.sh DIR [PYTHON]}
py=${2:-python3}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CUDA12=12.8
pins=(nvidia-cuda-nvcc-cu12==12.8.93 nvidia-cuda-runtime-cu12==12.8.90 nvidia-cuda-cccl-cu12==12.8.90
      nvidia-nvfatbin-cu12==12.8.90)

if [ -f "$dir/.complete" ] && [ "$(cat "$dir/.complete")" = "${pins[*]}" ]; then
  echo "CUDA $CUDA12 toolkit for clang: $dir (already assembled)"
  exit 0
fi
rm -rf "$dir"
mkdir -p "$dir"/{include,bin,lib64,nvvm,.wheels,.unpacked}
"$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$dir/.wheels" "${pins[@]}"
for whl in "$dir"/.wheels/*.whl; do
  "$py" -m zipfile -e "$whl" "$dir/.unpacked"
done
src="$dir/.unpacked/nvidia"
for part in cuda_runtime cuda_nvcc cuda_cccl; do
  cp -r "$src/$part/include/." "$dir/include/"
done
find "$dir/include" -name __init__.py -delete
cp "$src/cuda_nvcc/bin/ptxas" "$dir/bin/ptxas"
cp -r "$src/cuda_nvcc/nvvm/libdevice" "$dir/nvvm/"
cp "$src/cuda_runtime/lib/libcudart.so.12" "$dir/lib64/"
ln -sf libcudart.so.12 "$dir/lib64/libcudart.so"
cp "$src/nvfatbin/lib/libnvfatbin.so.12" "$dir/lib64/"
cp "$here/cuda12/fatbinary" "$dir/bin/fatbinary"
chmod +x "$dir/bin/ptxas" "$dir/bin/fatbinary"
rm -rf "$dir/.unpacked" "$dir/.wheels"
version=$(sed -n 's/^#define CUDA_VERSION \([0-9]*\).*/\1/p' "$dir/include/cuda.h")
[ "$version" = 12080 ] || { echo "expected CUDA_VERSION 12080 in $dir/include/cuda.h, found '$version'" >&2; exit 1; }
echo "${pins[*]}" > "$dir/.complete"
echo "CUDA $CUDA12 toolkit for clang: $dir (ptxas $("$dir/bin/ptxas" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
