"""Transformers families beyond Llama on tpcomm (tests/hf_families.py: tiny
random models loaded with their own TP plan, 2 and 3 gloo ranks, float32):
in eager tpcomm.install and under tpcomm.compile_backend the greedy tokens
are plain torch's; every row-parallel all-reduce (counted from the model's
modules and TP plan) runs fused with the norms around it when compiled,
once, under its pattern's key (Gemma's sandwich norm, OLMo's and Cohere's
LayerNorm, Granite's residual multiplier included; Cohere's parallel
attention + MLP all-reduces merged in pairs first), with no unfused warning; DTensor's all-gathers (LM head, colwise_gather_output) and
the embedding's all-reduce are counted under tpcomm in both modes
(hf_families.check). The transformers installed here; other versions:
.ci/test_transformers_versions.py."""
import json
import os
import subprocess
import sys

import pytest

from hf_families import check

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {2: "qwen3,mistral,gemma3,phi3,mixtral,granite,olmo,cohere", 3: "gemma3,phi3,cohere"}


@pytest.mark.parametrize("world", sorted(RUNS))
def test_families_on_gloo_ranks(tmp_path, world):
    out = tmp_path / "families.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
         os.path.join(ROOT, "tests", "hf_families.py"), RUNS[world], str(tmp_path / "models"), str(out)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    families = json.loads(out.read_text())["families"]
    assert set(families) == set(RUNS[world].split(","))
    failed = [f for family, r in families.items() for f in check(r["float32"], f"{family} at {world} ranks")]
    assert not failed, "\n".join(failed)
