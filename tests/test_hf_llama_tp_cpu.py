"""examples/hf_llama_tp.py on 2 gloo ranks (torchrun, a tiny random Llama
with transformers' own TP plan): every mode gives gloo's next tokens, the
eager tpcomm mode bit for bit (its fallback is gloo's all_reduce on the CPU),
and the compiled tpcomm mode runs every row-parallel all-reduce as the fused
op. Timing it needs several GPUs (docs/benchmarks.md)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import source_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS, REPS, BATCHES = 2, 2, (1, 3)


def test_every_mode_agrees_on_two_gloo_ranks(tmp_path):
    """Also: the random model goes to a temporary directory removed at the
    end, the results under the working directory's results/, nothing into
    the checkout."""
    before, tmp = source_tree.git_status(), tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         os.path.join(ROOT, "examples", "hf_llama_tp.py"), "--tiny", "--cpu", "--layers", str(LAYERS),
         "--reps", str(REPS), "--batches", ",".join(map(str, BATCHES))],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=source_tree.subprocess_env(OMP_NUM_THREADS="1", TMPDIR=str(tmp)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "results" / "hf_llama_tp_cpux2.json"
    assert source_tree.git_status() == before and source_tree.tpcomm_leftovers(tmp) == []
    data = json.loads(out.read_text())
    assert data["model"]["ranks"] == 2 and data["model"]["layers"] == LAYERS
    results = data["results"]
    for batch in map(str, BATCHES):
        entry = results[batch]
        # the torch.distributed modes named by what ran them: gloo here
        assert set(entry["s_per_forward"]) == {"gloo", "tpcomm", "gloo_compiled", "tpcomm_compiled"}
        for mode in entry["s_per_forward"]:
            assert entry[f"{mode}_tokens_agree"] is True, (batch, mode)
        assert entry["tpcomm_logits_max_abs_diff"] == 0.0
        assert entry["tpcomm_compiled_logits_max_abs_diff"] < 1e-5
    forwards = (1 + 3 + REPS) * len(BATCHES)  # the compared one, the warm-ups, the timed ones
    # two row-parallel all-reduces a layer, each fused with the add and norm after it when compiled
    assert results["tpcomm_calls"]["all_reduce_add_rms_norm/unfused"] == 2 * LAYERS * forwards
    assert results["tpcomm_calls"]["all_reduce/gloo"] >= 2 * LAYERS * forwards  # the eager mode's, at least
