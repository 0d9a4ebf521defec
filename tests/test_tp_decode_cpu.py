"""examples/tp_decode.py on the CPU: the TP split of the model (vocabulary-
parallel embedding and LM head, column- and row-parallel layers) over 2 gloo
processes gives the same tokens and logits through tpcomm's Communicator
(its NCCL fallback here) as through torch.distributed, with the expected
number of collectives per step; and the summary's arithmetic. Timing it under
CUDA graphs needs several GPUs (docs/benchmarks.md)."""
import json
import os
import subprocess
import sys

import source_tree


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import torch  # noqa: E402

import tp_decode  # noqa: E402


def test_tiny_model_over_two_gloo_ranks(tmp_path):
    """Without --out the example writes under its working directory's
    results/, nothing into the checkout, and leaves nothing in TMPDIR."""
    before, tmp = source_tree.git_status(), tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "tp_decode.py"), "--tiny", "--cpu",
                           "--batches", "1,3", "--context", "16"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=source_tree.subprocess_env(TMPDIR=str(tmp)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "batch 3: every backend run\n" in proc.stdout and "captured" not in proc.stdout  # no graphs on the CPU
    out = tmp_path / "results" / "tp_decode_cpux2.json"
    assert source_tree.git_status() == before and source_tree.tpcomm_leftovers(tmp) == []
    data = json.loads(out.read_text())
    run = data["runs"]["mixing default"]
    for batch, n in (("1", 1), ("3", 3)):
        assert run[batch]["tokens_agree"] is True and run[batch]["logits_bit_equal"] is True
        assert len(run[batch]["tokens"]) == n and all(0 <= t < tp_decode.TINY["vocab"] for t in run[batch]["tokens"])
    layers = tp_decode.TINY["layers"]
    # per step: the embedding's all_reduce, two per layer, one all_gather; two batch sizes
    assert run["tpcomm_calls"] == {"all_reduce/gloo": 2 * (1 + 2 * layers), "all_gather/gloo": 2}
    assert data["model"]["ranks"] == 2 and data["model"]["layers"] == layers


def test_fused_backend_on_two_gloo_ranks(tmp_path):
    """tpcomm_fused (all_reduce_add_rms_norm after every row-parallel
    matmul; its unfused path on gloo) gives NCCL's tokens, one fused call in
    place of each layer's all_reduce."""
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "tp_decode.py"), "--tiny", "--cpu",
                           "--batches", "2", "--context", "16", "--backends", "nccl,tpcomm_fused", "--out", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env=source_tree.subprocess_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())["runs"]["mixing default"]
    assert run["2"]["fused_tokens_agree"] is True
    assert run["2"]["fused_logits_max_abs_diff"] < 1e-3
    layers = tp_decode.TINY["layers"]
    # the embedding's all_reduce and 2 fused ops per layer, each counted once under its fused key
    assert run["tpcomm_calls"] == {"all_reduce/gloo": 1, "all_gather/gloo": 1,
                                   "all_reduce_add_rms_norm/unfused": 2 * layers}


def test_summary_arithmetic():
    runs = {"mixing default": {"1": {"ms_per_step": {"none": 10.0, "nccl": 12.2, "tpcomm": 10.9},
                                     "tokens_agree": True}},
            "mixing off": {"1": {"ms_per_step": {"none": 10.2, "nccl_nomix": 11.7}}}}
    row = tp_decode.summarize(runs)["1"]
    assert row["over_floor_pct"] == {"nccl": 22.0, "tpcomm": 9.0, "nccl_nomix": 14.7}
    assert row["ms_per_step"]["none (mixing off)"] == 10.2
    assert row["tpcomm_faster_than_pct"] == {"nccl": 10.7, "nccl_nomix": 6.8}
    assert row["tokens_agree (mixing default)"] is True


def test_fused_steps_are_measured_against_the_fused_floor():
    """*_fused backends over none_fused (the step without communication,
    add and norm fused), every backend over none; floors named per process set."""
    runs = {"mixing default": {"8": {"ms_per_step": {"none": 10.0, "none_fused": 9.5, "tpcomm": 10.5,
                                                     "tpcomm_fused": 9.69, "nccl": 12.0}}}}
    row = tp_decode.summarize(runs)["8"]
    assert row["over_floor_pct"] == {"tpcomm": 5.0, "tpcomm_fused": -3.1, "nccl": 20.0}
    assert row["over_fused_floor_pct"] == {"tpcomm_fused": 2.0}
    assert row["ms_per_step"]["none_fused (mixing default)"] == 9.5
    no_fused_floor = tp_decode.summarize({"mixing default": {"8": {"ms_per_step": {"none": 10.0, "tpcomm_fused": 9.0}}}})
    assert "over_fused_floor_pct" not in no_fused_floor["8"]


def test_fused_floor_computes_the_unfused_add_and_norm():
    """none_fused's add_norm (torch.compile'd: one kernel) gives what the
    unfused add and norm give, up to the order of the norm's sum."""
    g = torch.Generator().manual_seed(5)
    y, x, w = (torch.randn(3, 64, generator=g) for _ in range(3))
    normed, summed = tp_decode.local_fused_add_norm()(y, x, w[0])
    want_normed, want_summed = tp_decode.unfused_add_norm(lambda t: t)(y, x, w[0])
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed, want_normed, rtol=2e-6, atol=1e-6)


def test_fused_floor_on_two_gloo_ranks(tmp_path):
    """none_fused runs (no collective: its tokens are not NCCL's) beside
    tpcomm_fused, and tpcomm's calls are only tpcomm_fused's."""
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "tp_decode.py"), "--tiny", "--cpu",
                           "--batches", "2", "--context", "16", "--backends", "none_fused,nccl,tpcomm_fused",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=source_tree.subprocess_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())["runs"]["mixing default"]
    assert run["2"]["fused_tokens_agree"] is True
    layers = tp_decode.TINY["layers"]
    assert run["tpcomm_calls"] == {"all_reduce/gloo": 1, "all_gather/gloo": 1,
                                   "all_reduce_add_rms_norm/unfused": 2 * layers}


def test_needs_two_gpus_without_cpu_flag(monkeypatch, capsys):
    monkeypatch.setattr(tp_decode.torch.cuda, "device_count", lambda: 0)
    assert tp_decode.main(["--tiny"]) == 0
    assert "needs 2 GPUs" in capsys.readouterr().out
