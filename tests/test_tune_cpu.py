"""python -m tpcomm.tune without a GPU: deriving the routing table from
benchmark results (a hand-written run whose winners are known, and the
committed runs, from which the shipped table must follow), the file it writes
loading as a table, and the live mode saying it measured nothing."""
import json
import os
import subprocess
import sys
import tomllib

import pytest

from tpcomm import routing, routing_table, tune

import source_tree

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


# A run of 3 ranks written by hand: its winners are known without tune.
SIZES = (64, 1024, 16 * 1024, 256 * 1024, 4 << 20)
HAND_RUN = {"env": {"world_size": 3, "gpu": "NVIDIA H200", "driver": "1", "torch": "2", "nccl": "2", "date": "d"},
            "rows": (
    # all_reduce bf16: packet, line, line, bulk (a faster row that is wrong never wins), nccl
    [_row(n, b, t) for n, ts in zip(SIZES, [(2.0, 2.5, 9.0, 10.0), (3.0, 2.9, 9.0, 10.0), (5.0, 4.0, 6.0, 10.0),
                                          (30.0, 25.0, 20.0, 25.0), (900.0, 900.0, 300.0, 200.0)])
     for b, t in zip(("tpcomm_packet", "tpcomm_line", "tpcomm_bulk", "nccl"), ts)]
    + [_row(256 * 1024, "tpcomm_packet", 1.0, correct=False)]
    # all_reduce fp32: nccl, packet, a tie of packet and bulk (packet), bulk, bulk; eager and
    # unroutable rows that would win are ignored
    + [_row(n, b, t, dtype="float32") for n, ts in zip(SIZES, [(2.0, 1.0), (1.0, 5.0), (3.0, 4.0), (9.0, 9.5),
                                                               (99.0, 99.5)])
       for b, t in zip(("tpcomm_packet", "nccl"), ts)]
    + [_row(n, "tpcomm_bulk", t, dtype="float32") for n, t in zip(SIZES[1:], (9.0, 3.0, 8.0, 90.0))]
    + [_row(64, "tpcomm_packet", 0.1, dtype="float32", mode="eager"), _row(1024, "symm_one_shot", 0.1, dtype="float32")]
    # all_gather: bf16 packet, packet, bulk, nccl; its fp32 rows do not make a row of their own
    + [_row(n, b, t, op="all_gather") for n, (b, t) in zip(SIZES, [("tpcomm_packet", 1.0), ("tpcomm_packet", 2.0),
                                                                   ("tpcomm_bulk", 3.0), ("nccl", 4.0)])]
    + [_row(64, "tpcomm_bulk", 1.0, op="all_gather", dtype="float32")]
    # reduce_scatter: float16 only (then "*" is its row): packet, bulk
    + [_row(64, "tpcomm_packet", 1.0, op="reduce_scatter", dtype="float16"),
       _row(1024, "tpcomm_bulk", 1.0, op="reduce_scatter", dtype="float16"),
       _row(1024, "tpcomm_packet", 2.0, op="reduce_scatter", dtype="float16")])}
HAND_BASE = {"routes": {"all_reduce": {"*": {"*": [[1024, "packet"]]}, "3": {"*": [[32, "packet"]]}},
                        "all_gather": {"*": {"*": [[2048, "packet"]]}},
                        "reduce_scatter": {"*": {"*": [[4096, "packet"]]}}}}


def test_table_from_a_hand_written_run():
    ar_bf16 = [[64, "packet"], [16 * 1024, "line"], [256 * 1024, "bulk"]]
    ar_fp32 = [[64, "nccl"], [16 * 1024, "packet"], [4 << 20, "bulk"]]
    rs = [[64, "packet"], [1024, "bulk"]]
    table = tune.derive_table(HAND_RUN, base=HAND_BASE)
    assert table["routes"] == {
        "all_reduce": {"*": {"*": [[1024, "packet"]]},  # other world sizes: the base's rows
                       "3": {"*": ar_bf16, "bfloat16": ar_bf16, "float32": ar_fp32}},  # its own "3" replaced
        "all_gather": {"*": {"*": [[2048, "packet"]]}, "3": {"*": [[1024, "packet"], [16 * 1024, "bulk"]]}},
        "reduce_scatter": {"*": {"*": [[4096, "packet"]]}, "3": {"*": rs, "float16": rs}},
    }
    assert table["about"].startswith("python -m tpcomm.tune: 3x NVIDIA H200")
    assert routing_table.load_table(table) is not None


def test_results_without_a_world_size_are_refused():
    with pytest.raises(ValueError, match="world size"):
        tune.derive_table({"env": {}, "rows": HAND_RUN["rows"]}, base=HAND_BASE)


@pytest.mark.parametrize("run", ["h200x2", "h200x4"])
def test_the_shipped_table_is_what_tune_derives_from_the_committed_runs(run):
    """The shipped table's rows for a measured world size are `tune --from`
    that committed run (a re-measured run needs a re-derived table)."""
    with open(os.path.join(ROOT, "benchmarks", "results", f"{run}.json")) as f:
        results = json.load(f)
    world = str(results["env"]["world_size"])
    derived = tune.derive_table(results)["routes"]
    shipped = routing_table.load_table()["routes"]
    for op in routing.OPS:
        assert {d: [list(b) for b in bands] for d, bands in shipped[op][world].items()} == derived[op][world], op
        assert derived[op][world]["*"][0][1] == "packet"  # decode sizes: the packet kernel was the fastest measured


def test_command_writes_a_table_the_communicator_loads(tmp_path):
    out = tmp_path / "table.json"
    proc = subprocess.run([sys.executable, "-m", "tpcomm.tune", "--from", COMMITTED, "--out", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env=source_tree.subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"TPCOMM_TABLE={out}" in proc.stdout
    assert routing_table.load_table(str(out))["routes"]["all_gather"]["2"]["*"][0][1] == "packet"


def test_runs_at_several_world_sizes_extend_one_file(tmp_path):
    """A run at another world size keeps the rows already in --out and
    replaces only its own; without --out the file is named for the GPU model."""
    out = tmp_path / "h200.json"
    mine = {"about": "test", "routes": {op: {"*": {"*": [[16, "nccl"]]}, "2": {"*": [[32, "packet"]]},
                                            "8": {"*": [[48, "bulk"]]}} for op in routing.OPS}}
    out.write_text(json.dumps(mine))
    env = source_tree.subprocess_env()
    run4 = os.path.join(ROOT, "benchmarks", "results", "h200x4.json")
    proc = subprocess.run([sys.executable, "-m", "tpcomm.tune", "--from", run4, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"extended {out} (world size 4)" in proc.stdout
    routes = routing_table.load_table(str(out))["routes"]
    for op in routing.OPS:
        assert routes[op]["2"]["*"] == [(32, "packet")] and routes[op]["8"]["*"] == [(48, "bulk")], op
        assert routes[op]["4"] == routing_table.load_table()["routes"][op]["4"], op  # as derived from that run
    proc = subprocess.run([sys.executable, "-m", "tpcomm.tune", "--from", COMMITTED], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "tpcomm_table_h200.json").exists(), proc.stdout


def test_tables_are_named_for_the_gpu_model():
    assert [routing_table.gpu_model(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
                                          "AMD Instinct MI300X", "NVIDIA H200 NVL")] == \
        ["h200", "h100", "a100", "mi300x", "h200"]
    assert routing_table.table_for_device("NVIDIA H200") == os.path.join(routing_table.TABLES, "h200.json") == routing_table.DEFAULT_TABLE
    assert routing_table.table_for_device("NVIDIA H200 NVL") == routing_table.DEFAULT_TABLE
    assert routing_table.table_for_device("NVIDIA A100-SXM4-80GB") == routing_table.DEFAULT_TABLE  # none shipped: the H200 one
    assert routing_table.table_for_device(None) == routing_table.DEFAULT_TABLE
    shipped = {os.path.splitext(f)[0] for f in os.listdir(routing_table.TABLES) if f.endswith(".json")}
    assert shipped == {"h200"}, "a table file per GPU model, named by routing_table.gpu_model"


def test_live_mode_without_gpus_measures_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tpcomm.tune", "--out", str(tmp_path / "t.json")],
                          capture_output=True, text=True, timeout=300,
                          env=source_tree.subprocess_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "nothing was measured" in proc.stdout
    assert not (tmp_path / "t.json").exists()


def test_console_script():
    """`tpcomm tune` (pyproject.toml's one console script) runs tune.main."""
    from tpcomm import cli

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {"tpcomm": "tpcomm.cli:main"}
    assert cli.COMMANDS["tune"][0] == "tpcomm.tune" and callable(tune.main)
