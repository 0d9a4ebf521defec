#!/usr/bin/env bash
# tests/hf_families.py under the transformers versions of VERSIONS and the venv's own (called by
# .ci/run): each version goes into a side directory of the venv, $VENV/transformers/<version>, holding
# transformers and those of its dependencies whose versions differ from the venv's (what pip would
# change in the venv: its resolver's report, then those packages alone into the directory); then
# .ci/test_transformers_versions.py runs the families under each. A directory already holding its
# version is kept (`--install` installs them and stops). Prints each step's time. Env: PY (the venv's python; default .venv/bin/python),
# TPCOMM_TEST_VERSIONS_JSON (where the test writes every run's results, for scripts/benchmark_tables.py),
# TPCOMM_TEST_TRANSFORMERS_SIDE (the side directories' parent instead).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
# the newest 4.x (row-parallel all-reduces are DTensor redistributes: fused after AOT autograd) and a
# 5.x before 5.22 (backward hooks on q_norm / k_norm; the GPU image's version); the venv's is the newest
VERSIONS="4.57.6 5.17.0"
PY="${PY:-$ROOT/.venv/bin/python}"
SIDE="${TPCOMM_TEST_TRANSFORMERS_SIDE:-$(dirname "$(dirname "$PY")")/transformers}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
t0=$(date +%s)
step() { echo "== transformers versions: $1 ($(( $(date +%s) - t0 )) s so far)"; }

dirs=()
for v in $VERSIONS; do
  dir="$SIDE/$v"
  dirs+=("$dir")
  if PYTHONPATH="$dir" "$PY" -c "import sys, transformers; sys.exit(transformers.__version__ != '$v')" 2>/dev/null; then
    continue
  fi
  step "installing transformers $v into $dir"
  rm -rf "$dir"
  report="$(mktemp)"
  "$PY" -m pip install -q --progress-bar off --dry-run --report "$report" "transformers==$v"
  mapfile -t packages < <("$PY" - "$report" <<'PYTHON'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print("{name}=={version}".format(**item["metadata"]))
PYTHON
)
  rm -f "$report"
  "$PY" -m pip install -q --progress-bar off --no-deps --target "$dir" "${packages[@]}"
  PYTHONPATH="$dir" "$PY" -c "import transformers; assert transformers.__version__ == '$v', transformers.__file__"
done

[ "${1:-}" != --install ] || { step "installed"; exit 0; }
step "tests under ${VERSIONS// /, } and the venv's $("$PY" -c 'import transformers; print(transformers.__version__)')"
status=0
TPCOMM_TEST_TRANSFORMERS_DIRS="$(IFS=:; echo "${dirs[*]}")" "$PY" -m pytest -q -rs .ci/test_transformers_versions.py \
  || status=$?
step "done"
exit "$status"
