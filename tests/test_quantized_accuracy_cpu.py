"""examples/quantized_accuracy.py at a tiny size on the CPU: it trains, then
scores the held-out text and decodes greedily without TP and at TP2 (2 gloo
processes, the all-reduces' references: the exact kernels' rank-order sum
and the quantized kernel's emulation), and writes the JSON and the table
docs/benchmarks.md takes. The real run (25 M parameters, TP2 and TP4 on one
H200, tpcomm's kernels) is scripts/device_run.sh accuracy."""
import json
import math
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import quantized_accuracy  # noqa: E402


def test_tiny_run_on_the_cpu(tmp_path):
    out, ckpt = tmp_path / "acc.json", tmp_path / "w.pt"
    cmd = [sys.executable, os.path.join(ROOT, "examples", "quantized_accuracy.py"), "--tiny", "--cpu",
           "--train-steps", "3", "--batch", "4", "--eval-tokens", "256", "--prompts", "4", "--tp", "2",
           "--checkpoint", str(ckpt), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["training"]["steps"] == 3 and math.isfinite(data["training"]["final_loss"])
    assert data["model"]["layers"] == quantized_accuracy.TINY["layers"] and data["model"]["parameters"] > 0
    assert data["eval"]["prompts"] == 4 and data["seed"] == 0 and "--tiny" in data["command"]
    no_tp = data["results"]["no_tp"]["perplexity"]
    tp2 = data["results"]["tp2"]
    assert set(tp2) == {"exact", "fp8", "int8", "int4"}
    assert tp2["exact"]["agree_with_exact_tp"] == 1.0
    # the shards compute the same model: TP's exact sums differ from one process's only by rounding
    assert abs(tp2["exact"]["perplexity"] / no_tp - 1) < 0.01, (tp2["exact"], no_tp)
    for mode in ("fp8", "int8", "int4"):
        assert 1 < tp2[mode]["perplexity"] < 2 * no_tp and 0 <= tp2[mode]["agree_with_exact_tp"] <= 1
    assert "| TP2 | tpcomm quantized int4 |" in proc.stdout and "| no TP | none |" in proc.stdout
    # the checkpoint is reused: no training the second time
    proc = subprocess.run(cmd[:-1] + [str(tmp_path / "again.json")], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0 and "weights from" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads((tmp_path / "again.json").read_text())["results"] == data["results"]


def test_the_smoke_test_is_sized_to_finish_within_a_minute():
    """The docstring's CPU smoke test takes --tiny's sizes: at most 15 s of
    training (not the real run's minutes), TP2, a few prompts; options
    still override them; a run without --tiny keeps the real sizes."""
    line = next(l for l in quantized_accuracy.__doc__.splitlines() if l.strip().endswith("# the CPU smoke test"))
    words = shlex.split(line.split("#")[0])
    assert words[:2] == ["python", "examples/quantized_accuracy.py"] and "--tiny" in words and "--cpu" in words
    smoke = quantized_accuracy.parse_args(words[2:])
    assert smoke.train_minutes * 60 <= 15 and smoke.tp == "2", smoke
    assert smoke.eval_tokens <= 1024 and smoke.prompts <= 8 and smoke.batch <= 8 and smoke.train_steps <= 100, smoke
    assert quantized_accuracy.parse_args(["--tiny", "--train-minutes", "2"]).train_minutes == 2
    real = quantized_accuracy.parse_args([])
    assert (real.train_minutes, real.tp, real.prompts) == (9.0, "2,4", 64)


def test_shards_split_the_model():
    cfg = quantized_accuracy.TINY
    weights = quantized_accuracy.init_weights(cfg, 0)
    parts = [quantized_accuracy.shard(weights, cfg, r, 4) for r in range(4)]
    for name in ("q", "gate"):
        assert sum(p[f"0.{name}"].shape[1] for p in parts) == weights[f"0.{name}"].shape[1]
    assert sum(p["embed"].shape[0] for p in parts) == cfg["vocab"] and parts[3]["vocab_start"] == 3 * cfg["vocab"] // 4
    assert all(p["0.down"].shape[0] == cfg["mlp"] // 4 for p in parts)
