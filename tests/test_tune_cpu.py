"""python -m tpcomm.tune without a GPU: deriving the routing table from
benchmark results (the committed 2xH200 run and synthetic rows), the file it
writes loading as a table, and the live mode saying it measured nothing."""
import importlib.metadata
import json
import os
import subprocess
import sys

from tpcomm import policy, tune

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = os.path.join(ROOT, "benchmarks", "results", "h200x2.json")


def _row(size, backend, us, op="all_reduce", dtype="bfloat16", mode="graph", correct=True):
    return {"op": op, "backend": backend, "dtype": dtype, "bytes_per_rank": size, "mode": mode,
            "median_us": us, "correct": correct}


def test_winners_pick_the_fastest_correct_graph_row():
    rows = [_row(64, "tpcomm_packet", 2.0), _row(64, "tpcomm_bulk", 9.0), _row(64, "nccl", 10.0),
            _row(256, "tpcomm_packet", 3.0), _row(256, "tpcomm_bulk", 3.0),            # a tie: packet
            _row(1024, "tpcomm_packet", 1.0, correct=False), _row(1024, "tpcomm_bulk", 5.0),  # a wrong row never wins
            _row(4096, "tpcomm_packet", 1.0, mode="eager"), _row(4096, "nccl", 4.0),     # eager rows do not count
            _row(4096, "symm_two_shot", 0.5),                                             # not routable
            _row(64, "tpcomm_packet", 0.1, dtype="float32")]                             # another dtype
    assert tune.winners(rows, "all_reduce", "bfloat16") == [(64, "packet"), (256, "packet"), (1024, "bulk"),
                                                            (4096, "nccl")]


def test_bands_merge_runs_and_drop_a_trailing_nccl_band():
    assert tune.bands([(64, "packet"), (256, "packet"), (1024, "bulk"), (4096, "nccl")]) == \
        [[256, "packet"], [1024, "bulk"]]
    assert tune.bands([(64, "packet"), (256, "nccl"), (1024, "bulk")]) == \
        [[64, "packet"], [256, "nccl"], [1024, "bulk"]]
    assert tune.bands([(64, "nccl")]) == []


def test_table_from_the_committed_benchmark():
    with open(COMMITTED) as f:
        results = json.load(f)
    table = tune.derive_table(results)
    assert policy.load_table(table) is not None
    routes = table["routes"]
    for op in policy.OPS:
        assert "2" in routes[op] and "*" in routes[op]
        bf16 = policy.bands_for(policy.load_table(table), op, 2, "bfloat16")
        assert bf16[0][1] == "packet"  # decode sizes: tpcomm's packet kernel is the fastest measured
    # every band's backend really was the fastest at its limit in that run
    for limit, backend in routes["all_reduce"]["2"]["bfloat16"]:
        won = dict(tune.winners(results["rows"], "all_reduce", "bfloat16"))
        assert won[limit] == backend
    # the world sizes it did not measure come from the shipped table
    assert routes["all_reduce"]["*"]["*"] == [list(b) for b in policy.load_table()["routes"]["all_reduce"]["*"]["*"]]
    assert "2x NVIDIA H200" in table["about"]


def test_command_writes_a_table_the_communicator_loads(tmp_path):
    out = tmp_path / "table.json"
    proc = subprocess.run([sys.executable, "-m", "tpcomm.tune", "--from", COMMITTED, "--out", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"TPCOMM_TABLE={out}" in proc.stdout
    assert policy.load_table(str(out))["routes"]["all_gather"]["2"]["*"][0][1] == "packet"


def test_live_mode_without_gpus_measures_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tpcomm.tune", "--out", str(tmp_path / "t.json")],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "nothing was measured" in proc.stdout
    assert not (tmp_path / "t.json").exists()


def test_console_script():
    scripts = {ep.name: ep.value for ep in importlib.metadata.distribution("tpcomm").entry_points
               if ep.group == "console_scripts"}
    assert scripts.get("tpcomm-tune") == "tpcomm.tune:main"
