#!/usr/bin/env bash
# Tests an installed tpcomm wheel in one torch version: a venv with that torch
# from PyPI (made unless VENV already has it), the wheel installed into it
# (not the source tree), then: tpcomm imports from site-packages and its
# extension loads, its libraries carry no RUNPATH, `tpcomm doctor` exits 0,
# and the CPU tests that prove the install pass (WHEEL_TESTS: the package
# alone registers the ops, the ops and the vLLM plugin on gloo ranks, the
# doctor's console script, the quick start; the doctor's logic is the
# suite's). They run from a copy of the checkout's
# tracked files, where no in-place build exists, with TPCOMM_TEST_INSTALLED=1,
# which keeps python/ off sys.path and off every child's PYTHONPATH
# (tests/source_tree.py; tests/test_source_tree_cpu.py checks it). The whole
# suite runs once, against the in-place build (.ci/run).
# Usage: .ci/test_wheel.sh WHEEL TORCH_VERSION VENV
#        .ci/test_wheel.sh --prepare TORCH_VERSION VENV [PACKAGE ...]   (the venv alone, with PACKAGEs too)
#   env: PYTHON (makes the venv; default python3), WHEEL_TESTS (pytest arguments)
set -euo pipefail
usage="usage: test_wheel.sh WHEEL|--prepare TORCH_VERSION VENV"
wheel=${1:?$usage}
[ "$wheel" = --prepare ] || wheel=$(readlink -f "$wheel")
torch_version=${2:?$usage}
venv=${3:?$usage}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1

start=$(date +%s)
py="$venv/bin/python"
have=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$torch_version" ]; then
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
fi
"$py" -m pip install -q --progress-bar off "torch==$torch_version" numpy pytest hypothesis transformers accelerate \
  matplotlib tqdm "${@:4}"
if [ "$wheel" = --prepare ]; then
  echo "venv $venv: torch $torch_version ready in $(( $(date +%s) - start )) s"
  exit 0
fi
"$py" -m pip install -q --progress-bar off --no-deps --force-reinstall "$wheel"
echo "== $(basename "$wheel") in torch $("$py" -c 'import torch; print(torch.__version__, "(CUDA", torch.version.cuda, end=")")') (venv ready in $(( $(date +%s) - start )) s)"

# Outside the checkout, so nothing but site-packages can provide tpcomm.
cd "$venv"
"$py" - "$wheel" <<'PY'
import importlib.metadata, os, sys, sysconfig
import tpcomm
from tpcomm import _lib
site = sysconfig.get_paths()["purelib"]
assert tpcomm.__file__.startswith(site), f"tpcomm imported from {tpcomm.__file__}, not {site}"
_lib.load()  # raises with the reason when the extension does not load in this torch
version = importlib.metadata.version("tpcomm")
assert version.split("+")[0] == tpcomm.__version__, (version, tpcomm.__version__)
assert os.path.basename(sys.argv[1]).startswith(f"tpcomm-{version}-"), (version, sys.argv[1])
print(f"tpcomm {version} from {os.path.dirname(tpcomm.__file__)}: extension loads")
PY
for so in "$("$py" -c 'import os, tpcomm; print(os.path.dirname(tpcomm.__file__))')"/*.so; do
  if readelf -d "$so" | grep -qE "\((RPATH|RUNPATH)\)"; then
    echo "$so carries a run path: $(readelf -d "$so" | grep -E 'RPATH|RUNPATH')" >&2; exit 1
  fi
done
"$venv/bin/tpcomm" doctor --no-self-test > "$venv/doctor.txt" || { cat "$venv/doctor.txt"; exit 1; }
grep -E "^(tpcomm distribution|torch|links|loads|ok):" "$venv/doctor.txt"

src="$venv/checkout"
rm -rf "$src" && mkdir -p "$src"
git -C "$ROOT" ls-files -z --cached --others --exclude-standard | (cd "$ROOT" && xargs -0 cp --parents -t "$src")
if ls "$src"/python/tpcomm/*.so >/dev/null 2>&1; then echo "the test copy holds a build" >&2; exit 1; fi
cd "$src"
status=0
tests=(tests/test_source_tree_cpu.py tests/test_package_cpu.py tests/test_ops_cpu.py
       tests/test_vllm_plugin_cpu.py tests/test_quickstart_cpu.py
       tests/test_doctor_cpu.py::test_console_script_runs_the_doctor_and_tells_its_version
       tests/test_packaging_cpu.py::test_built_extension_carries_no_run_path)
[ -z "${WHEEL_TESTS:-}" ] || read -ra tests <<<"$WHEEL_TESTS"
TPCOMM_TEST_INSTALLED=1 "$py" -m pytest -q -rs -p no:cacheprovider "${tests[@]}" || status=$?
cd "$ROOT" && rm -rf "$src"
echo "torch $torch_version: wheel tests done in $(( $(date +%s) - start )) s (pytest exit $status)"
exit "$status"
