#!/usr/bin/env bash
# Tests an installed tpcomm wheel in one torch version: a venv with that torch
# from PyPI (made unless VENV already has it), the wheel installed into it
# (not the source tree: TPCOMM_TEST_INSTALLED=1 keeps python/ off sys.path),
# then: tpcomm imports from site-packages and its extension loads, `tpcomm
# doctor` exits 0, and the CPU test suite passes (GPU tests skip).
# Usage: .ci/test_wheel.sh WHEEL TORCH_VERSION VENV
#   env: PYTHON (makes the venv; default python3)
set -euo pipefail
wheel=$(readlink -f "${1:?usage: test_wheel.sh WHEEL TORCH_VERSION VENV}")
torch_version=${2:?usage: test_wheel.sh WHEEL TORCH_VERSION VENV}
venv=${3:?usage: test_wheel.sh WHEEL TORCH_VERSION VENV}
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
  matplotlib tqdm
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
"$venv/bin/tpcomm" doctor --no-self-test > "$venv/doctor.txt" || { cat "$venv/doctor.txt"; exit 1; }
grep -E "^(tpcomm distribution|torch|links|loads|ok):" "$venv/doctor.txt"

cd "$ROOT"
status=0
TPCOMM_TEST_INSTALLED=1 "$py" -m pytest -q -rs -p no:cacheprovider tests || status=$?
echo "torch $torch_version: wheel tests done in $(( $(date +%s) - start )) s (pytest exit $status)"
exit "$status"
