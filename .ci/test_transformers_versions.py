"""tests/hf_families.py under other transformers versions than the one the
suite runs (tests/test_hf_families_cpu.py): each side directory of
TPCOMM_TEST_TRANSFORMERS_DIRS (.ci/transformers_versions.sh installs them), put
first on the ranks' PYTHONPATH, and the environment's own transformers (the
newest). Every family on 2 gloo ranks, compiled with tpcomm.compile_backend
after tpcomm.skip_backward_hooks_without_grad: every row-parallel all-reduce
fused with its norms, DTensor's collectives on tpcomm, nothing reported
unfused, float32 tokens plain torch's and bf16 logits as accurate as plain
torch's (hf_families.check). Where the model holds backward hooks
(transformers 5.3 to 5.21), the compile before the helper must warn of the
graph breaks. Each version runs float32 and bf16. With TPCOMM_TEST_VERSIONS_JSON
set, every run's results go there (docs/testing.md's table: python
scripts/benchmark_tables.py reads benchmarks/results/transformers_versions_cpu.json)."""
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from hf_families import check  # noqa: E402

FAMILIES = "qwen3,mistral,gemma3,phi3,mixtral,granite,olmo,cohere"
SIDE = [d for d in os.environ.get("TPCOMM_TEST_TRANSFORMERS_DIRS", "").split(os.pathsep) if d]
DTYPES = "float32,bfloat16"
RUNS = SIDE + [None]  # the side directories, then the environment's own transformers
pytestmark = pytest.mark.skipif(not SIDE, reason="no TPCOMM_TEST_TRANSFORMERS_DIRS: run .ci/transformers_versions.sh")
_results = {}


@pytest.mark.parametrize("side", RUNS, ids=[os.path.basename(d or "environment") for d in RUNS])
def test_families_under_transformers(tmp_path, side):
    out = tmp_path / "families.json"
    path = [side] if side else []
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         os.path.join(ROOT, "tests", "hf_families.py"), FAMILIES, str(tmp_path / "models"), str(out),
         "--dtypes", DTYPES, "--modes", "compiled_unprepared,compiled"],
        capture_output=True, text=True, timeout=1200, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(path + [os.path.join(ROOT, "python")]), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    if side:
        assert run["transformers"] == os.path.basename(side), (run["transformers"], side)
    run["seconds"] = round(time.monotonic() - start)
    _save(run)
    failed = [f for family, by_dtype in run["families"].items() for dtype, r in by_dtype.items()
              for f in check(r, f"transformers {run['transformers']}, {family}, {dtype}", dtype == "float32")]
    assert not failed, "\n".join(failed)


def _save(run):
    path = os.environ.get("TPCOMM_TEST_VERSIONS_JSON")
    if path:
        _results[run["transformers"]] = run
        with open(path, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "runs": _results}, f, indent=1)
