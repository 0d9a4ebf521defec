"""Transformers families beyond Llama on tpcomm (tests/hf_families.py: tiny
random models loaded with their own TP plan, 2 and 3 gloo ranks, float32):
in eager tpcomm.install and under tpcomm.compile_backend the greedy tokens
are plain torch's; every row-parallel all-reduce (counted from the model's
modules and TP plan) runs fused with the norms around it when compiled,
once, under its pattern's key (Gemma's sandwich norm included); DTensor's
all-gathers (LM head, colwise_gather_output) and the embedding's all-reduce
are counted under tpcomm in both modes."""
import json
import os
import subprocess
import sys

import pytest

from hf_families import by_op

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {2: "qwen3,mistral,gemma3,phi3,mixtral", 3: "gemma3,phi3"}


@pytest.mark.parametrize("world", sorted(RUNS))
def test_families_on_gloo_ranks(tmp_path, world):
    out = tmp_path / "families.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
         os.path.join(ROOT, "tests", "hf_families.py"), RUNS[world], str(tmp_path / "models"), str(out)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == set(RUNS[world].split(","))
    for family, r in results.items():
        rows, gathers, embeddings = r["row_parallel_per_forward"], r["gathered_per_forward"], r["embedding_all_reduces"]
        assert rows > 0, family
        fused_key = r["fused_key"]
        for mode, m in r["modes"].items():
            what = f"{family} at {world} ranks, {mode}"
            assert m["tokens_agree"], what
            calls = m["calls"]
            ops = by_op(calls)
            assert ops.get("all_gather", 0) == gathers, (what, calls)
            if mode == "install":  # eager: each row-parallel all-reduce, and the embedding's, on tpcomm
                assert ops == {k: v for k, v in {"all_reduce": rows + embeddings, "all_gather": gathers}.items()
                               if v}, (what, calls)
                continue
            # compiled: each row-parallel all-reduce fused, counted once under its pattern's key
            assert ops.get(fused_key) == rows, (what, calls)
            assert ops.get("all_reduce", 0) == embeddings, (what, calls)
            assert m["pass"][fused_key] == rows and m["pass"]["all_gather"] == gathers, (what, m["pass"])
