"""tpcomm.bench without a GPU: the size list, the bandwidth formulas, the
tables and the results file, the figures (when matplotlib is importable), the
command on a machine without GPUs, and the measurement loop itself run on
CPU tensors over gloo with fake timers (the CUDA-only backends must come out
as "not run" with their reasons, never as a crash)."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from multiproc import run_ranks
import source_tree
from tpcomm.bench import bandwidth, options, results_file, tables, timing, vocabulary, worker

KiB = 1024
MiB = 1024 * KiB
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- sizes
def test_default_size_list_is_x4_from_64_bytes_to_64_mib():
    s = options.size_list(64, 64 * MiB, 4)
    assert s[0] == 64 and s[-1] == 64 * MiB
    assert len(s) == 11
    assert all(b == 4 * a for a, b in zip(s, s[1:]))
    assert s[:4] == [64, 256, 1 * KiB, 4 * KiB]


def test_size_list_appends_the_maximum_and_checks_its_arguments():
    assert options.size_list(64, 1000, 4) == [64, 256, 1000]
    assert options.size_list(64, 64, 4) == [64]
    assert options.size_list(64, 512, 2) == [64, 128, 256, 512]
    for bad in ((0, 64, 4), (128, 64, 4), (64, 128, 1)):
        with pytest.raises(ValueError):
            options.size_list(*bad)


def test_dtype_and_choice_parsing():
    assert options.parse_dtypes("bf16,fp16,fp32") == ["bfloat16", "float16", "float32"]
    assert options.parse_dtypes("bfloat16, bf16") == ["bfloat16"]
    with pytest.raises(ValueError):
        options.parse_dtypes("int8")
    assert options.parse_choices("nccl,tpcomm", vocabulary.BACKENDS, "backend") == ["nccl", "tpcomm"]
    with pytest.raises(ValueError):
        options.parse_choices("nccl,gloo", vocabulary.BACKENDS, "backend")


def test_human_bytes():
    assert vocabulary.human_bytes(64) == "64 B"
    assert vocabulary.human_bytes(1024) == "1 KiB"
    assert vocabulary.human_bytes(64 * MiB) == "64 MiB"
    assert vocabulary.human_bytes(1536) == "1.5 KiB"


# ------------------------------------------------------------ bandwidth
def test_algbw_definitions():
    # all_reduce: bytes per rank over time; all_gather: world * bytes over time
    assert bandwidth.algbw_gbps("all_reduce", 1_000_000, 2, 10.0) == pytest.approx(100.0)
    assert bandwidth.algbw_gbps("all_gather", 1_000_000, 2, 10.0) == pytest.approx(200.0)
    assert bandwidth.algbw_gbps("all_gather", 1_000_000, 4, 10.0) == pytest.approx(400.0)


def test_link_bytes_and_peer_fraction():
    assert bandwidth.link_bytes("all_reduce", 1000, 2) == pytest.approx(1000)
    assert bandwidth.link_bytes("all_reduce", 1000, 4) == pytest.approx(1500)
    assert bandwidth.link_bytes("all_gather", 1000, 2) == pytest.approx(1000)
    assert bandwidth.link_bytes("all_gather", 1000, 4) == pytest.approx(3000)
    # 1 MB over the link in 10 us is 100 GB/s: half of a 200 GB/s peer copy
    assert bandwidth.peer_fraction("all_reduce", 1_000_000, 2, 10.0, 200.0) == pytest.approx(0.5)
    assert bandwidth.peer_fraction("all_gather", 1_000_000, 4, 10.0, 600.0) == pytest.approx(0.5)
    assert bandwidth.peer_fraction("all_reduce", 1_000_000, 2, 10.0, None) is None


def test_add_bandwidth_only_from_one_mib():
    rows = [_row("all_reduce", "nccl", "bfloat16", 64 * KiB, "graph", 5.0),
            _row("all_reduce", "nccl", "bfloat16", 4 * MiB, "graph", 40.0),
            _row("all_gather", "nccl", "bfloat16", 4 * MiB, "graph", 40.0)]
    bandwidth.add_bandwidth(rows, 2, 400.0)
    assert "algbw_gbps" not in rows[0] and "peer_fraction" not in rows[0]
    assert rows[1]["algbw_gbps"] == pytest.approx(4 * MiB / 40e-6 / 1e9, rel=1e-3)
    assert rows[2]["algbw_gbps"] == pytest.approx(2 * rows[1]["algbw_gbps"], rel=1e-3)
    assert rows[1]["peer_fraction"] == pytest.approx(4 * MiB / 40e-6 / 400e9, rel=1e-2)
    no_peer = bandwidth.add_bandwidth([_row("all_reduce", "nccl", "bfloat16", 4 * MiB, "graph", 40.0)], 2, None)
    assert "algbw_gbps" in no_peer[0] and "peer_fraction" not in no_peer[0]


# ------------------------------------------------- tables, JSON, figures
def _row(op, backend, dtype, n, mode, t, correct=True):
    return {"op": op, "backend": backend, "dtype": dtype, "bytes_per_rank": n, "mode": mode,
            "median_us": t, "correct": correct}


def fake_results():
    """A small results dict shaped like a real run's."""
    rows = []
    speed = {"nccl": 1.0, "nccl_nomix": 0.6, "nccl_window": 0.8, "nccl_window_nomix": 0.4, "symm_one_shot": 0.5,
             "symm_two_shot": 0.7, "symm_two_shot_copied": 0.8, "tpcomm": 0.3, "tpcomm_packet": 0.3,
             "tpcomm_line": 0.35, "tpcomm_two_shot": 0.32, "tpcomm_bulk": 0.6, "tpcomm_quantized_fp8": 0.45,
             "tpcomm_quantized_int8": 0.45, "tpcomm_quantized_int4": 0.4}
    not_run = []
    for op in vocabulary.OPS:
        for dtype in ("bfloat16", "float32"):
            for n in options.size_list(64, 64 * MiB, 4):
                for b in vocabulary.BACKENDS:
                    if op != "all_reduce" and b.startswith("symm"):
                        not_run.append({"op": op, "backend": b, "dtype": dtype, "bytes_per_rank": n,
                                        "why": "all_reduce only"})
                        continue
                    if b in ("tpcomm_fused", "tpcomm_past_cap"):
                        not_run.append({"op": op, "backend": b, "dtype": dtype, "bytes_per_rank": n,
                                        "why": "the fused norm ops only"})
                        continue
                    if b == "tpcomm_two_shot" and op != "all_reduce":
                        not_run.append({"op": op, "backend": b, "dtype": dtype, "bytes_per_rank": n,
                                        "why": f"{op} has no two_shot kernel"})
                        continue
                    if b in ("tpcomm_packet", "tpcomm_line", "tpcomm_two_shot") and n > 1 * MiB:
                        not_run.append({"op": op, "backend": b, "dtype": dtype, "bytes_per_rank": n,
                                        "why": "over the packet cap of 1 MiB"})
                        continue
                    for mode in vocabulary.MODES:
                        t = (10.0 + n / 200e3) * speed[b] * (3.0 if mode == "eager" else 1.0)
                        rows.append(_row(op, b, dtype, n, mode, round(t, 3), correct=not (b == "tpcomm_bulk" and n == 64)))
    not_run.append({"op": "all_reduce", "backend": "nccl_window", "dtype": "float16", "bytes_per_rank": 64,
                    "mode": "graph", "why": "failed to run: RuntimeError: boom"})
    env = {"date": "2026-01-01", "world_size": 2, "gpu": "NVIDIA H200", "peer_copy_gbps": 380.0}
    bandwidth.add_bandwidth(rows, 2, env["peer_copy_gbps"])
    return {"env": env, "rows": rows, "not_run": not_run}


def test_tables_and_not_run_and_summary_render():
    data = fake_results()
    text = tables.format_tables(data)
    assert text.count("median us per op") == len(vocabulary.OPS) * 2 * 2  # op x dtype x mode
    for b in vocabulary.BACKENDS:
        assert b in text or b in ("tpcomm_fused", "tpcomm_past_cap")  # the norm ops' (test_norm_bench_cpu)
    assert "64 MiB" in text and "algbw GB/s" in text and "380 GB/s peer copy" in text
    assert "!" in text  # the row marked incorrect
    nr = tables.format_not_run(data["not_run"])
    assert "symm_one_shot" in nr and "all_reduce only" in nr and "(11 sizes)" in nr
    assert "nccl_window graph" in nr and "boom" in nr
    summary = tables.format_summary(data)
    assert "INCORRECT" in summary and "speed-up over nccl" in summary


def test_tables_tolerate_missing_and_bad_values():
    data = {"env": {}, "rows": [_row("all_reduce", "nccl", "bfloat16", 64, "graph", float("nan")),
                                _row("all_reduce", "tpcomm", "bfloat16", 64, "graph", 0.0),
                                _row("all_reduce", "newthing", "bfloat16", 64, "eager", 3.0)], "not_run": []}
    tables.format_tables(data)
    tables.format_summary(data)
    assert tables.format_tables({"env": {}, "rows": [], "not_run": []}) == ""


def test_json_round_trip_keeps_the_format(tmp_path):
    data = fake_results()
    data["rows"].append(_row("all_reduce", "nccl", "float16", 64, "graph", float("inf")))
    path = tmp_path / "sub" / "r.json"
    results_file.write_json(str(path), data)
    back = json.loads(path.read_text())
    assert set(back) == {"env", "rows", "not_run"}
    required = {"op", "backend", "dtype", "bytes_per_rank", "mode", "median_us"}
    assert all(required <= set(r) for r in back["rows"])
    assert back["rows"][-1]["median_us"] is None  # non-finite becomes null, not invalid JSON
    assert not (tmp_path / "sub" / "r.json.tmp").exists()


def test_default_out_path():
    """Under the working directory, in results/ (ignored by git), never the tracked benchmarks/results."""
    assert (results_file.default_out_path({"gpu": "NVIDIA H200", "world_size": 2})
            == os.path.join("results", "h200x2.json"))
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "/results/" in f.read().split()


def test_plots_render_valid_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from tpcomm.bench import plots

    stem = str(tmp_path / "h200x2")
    paths = plots.render(fake_results(), stem)
    names = sorted(os.path.basename(p) for p in paths)
    assert names == sorted([f"h200x2_{op}_{mode}.png" for op in vocabulary.OPS for mode in vocabulary.MODES]
                           + ["h200x2_speedup.png"])
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == PNG_SIGNATURE
        assert os.path.getsize(p) > 1000


def test_plots_command_line_redraws_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "res.json"
    results_file.write_json(str(path), fake_results())
    out = subprocess.run([sys.executable, "-m", "tpcomm.bench.plots", str(path)], capture_output=True, text=True,
                         timeout=300, env=_child_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    pngs = sorted(p.name for p in tmp_path.glob("res_*.png"))
    assert len(pngs) == 2 * len(vocabulary.OPS) + 1, pngs
    with open(tmp_path / "res_speedup.png", "rb") as f:
        assert f.read(8) == PNG_SIGNATURE


def test_plots_of_a_partial_run(tmp_path):
    pytest.importorskip("matplotlib")
    from tpcomm.bench import plots

    data = {"env": {"world_size": 2}, "rows": [_row("all_reduce", "nccl", "float32", 64, "graph", 10.0),
                                               _row("all_reduce", "tpcomm", "float32", 64, "graph", 3.0)],
            "not_run": []}
    paths = plots.render(data, str(tmp_path / "p"))
    assert sorted(os.path.basename(p) for p in paths) == ["p_all_reduce_graph.png", "p_speedup.png"]
    assert plots.render({"env": {}, "rows": [], "not_run": []}, str(tmp_path / "q")) == []


def test_progress_plain_lines(capsys):
    from tpcomm.bench.progress import Progress

    p = Progress(4, enabled=True, interval_s=0.0, stream=sys.stdout, use_tqdm=False)
    for _ in range(4):
        p.advance(1, "x")
    p.close()
    out = capsys.readouterr().out
    assert "4/4 (100%)" in out
    q = Progress(4, enabled=False, stream=sys.stdout)
    q.advance(4)
    q.write("hidden")
    assert "hidden" not in capsys.readouterr().out


# ------------------------------------------------------- the command
def _child_env():
    env = source_tree.subprocess_env()
    env["CUDA_VISIBLE_DEVICES"] = ""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def test_command_without_gpus_says_so_and_exits_0():
    out = subprocess.run([sys.executable, "-m", "tpcomm.bench", "--quick"], capture_output=True, text=True,
                         timeout=300, env=_child_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "needs at least 2 CUDA GPUs" in out.stdout
    assert "not run:" in out.stdout and "nccl_window" in out.stdout
    assert "torch" in out.stdout  # the environment is printed


def test_command_help_and_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "tpcomm.bench", "--help"], capture_output=True, text=True,
                         timeout=300, env=_child_env(), cwd=ROOT)
    assert out.returncode == 0 and "--sizes-step" in out.stdout and "--backends" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "tpcomm.bench", "--backends", "nccl,mpi"], capture_output=True,
                         text=True, timeout=300, env=_child_env(), cwd=ROOT)
    assert bad.returncode == 2 and "unknown backend" in bad.stderr


def test_time_graphs_interleaves_rounds(monkeypatch):
    """Every round replays every captured graph, in an order rotated by one
    per round, each timed replay after `settle` untimed ones; a graph that
    cannot be captured becomes that backend's error alone. CUDA graphs and
    events are faked: the order is what counts."""
    replayed = []

    class FakeGraph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            replayed.append(self.name)

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = len(replayed)

        def synchronize(self):
            pass

        def elapsed_time(self, end):  # ms: 1 per graph replayed in between, so every row reads 1 ms
            return float(end.at - self.at)

    def capture(call, ops):
        name = call()
        if name == "broken":
            raise RuntimeError("capture refused")
        return FakeGraph(name)

    monkeypatch.setattr(timing, "capture_graph", capture)
    monkeypatch.setattr(timing.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(timing, "barrier", lambda: None)
    names = ["a", "broken", "b", "c"]
    out = timing.time_graphs([lambda n=n: n for n in names], ops_per_graph=10, replays=4, settle=1)
    assert out[1][0] != out[1][0] and "capture refused" in out[1][1]  # nan, and why
    assert [o for i, o in enumerate(out) if i != 1] == [(100.0, None)] * 3  # 1 ms (one replay) / 10 ops
    rounds = replayed[9:]  # after 3 warm-up rounds of the three
    assert [rounds[i:i + 6] for i in range(0, 24, 6)] == [
        ["a", "a", "b", "b", "c", "c"], ["b", "b", "c", "c", "a", "a"],
        ["c", "c", "a", "a", "b", "b"], ["a", "a", "b", "b", "c", "c"]]
    # one graph: its replays in a row, none untimed
    replayed.clear()
    assert timing.time_graphs([lambda: "a"], ops_per_graph=10, replays=5) == [(100.0, None)]
    assert replayed == ["a"] * 8


# ------------------------------------- the measurement loop on CPU (gloo)
def _sim_rank(rank, world, out_path, merge_path=None):
    """One rank of the loop on CPU: CUDA calls and timers are faked, the
    collectives are real (gloo)."""
    import argparse

    from tpcomm.bench import __main__ as cli

    torch.cuda.synchronize = lambda *a, **k: None
    fake_t = {"graph": 5.0, "eager": 9.0}

    def fake_time(mode):
        def timer(call, ops, reps):
            for _ in range(2):
                call()
            return fake_t[mode] + rank + ops * 0.0
        return timer

    def fake_graphs(calls, ops, reps, settle=0):
        for call in calls:
            for _ in range(2):
                call()
        return [(fake_t["graph"] + rank, None) for _ in calls]

    worker.time_graphs = fake_graphs
    worker.time_eager = fake_time("eager")
    args = cli.parse_args(["--max-bytes", str(4 * MiB), "--sizes-step", "16", "--dtypes", "bf16,fp32",
                           "--out", out_path, "--no-progress"]
                          # the merging run times its graphs interleaved (the default), the other one
                          # after the other
                          + (["--merge-from", merge_path] if merge_path else ["--sequential"]))
    assert isinstance(args, argparse.Namespace)
    worker._run(rank, world, torch.device("cpu"), args, None)


def _run_sim(out_path, merge_path=None):
    """The measurement loop on 2 gloo ranks (_sim_rank); the results it wrote."""
    run_ranks(2, _sim_rank, out_path, merge_path, timeout=240)
    with open(out_path) as f:
        return json.load(f)


def test_measurement_loop_on_cpu_with_gloo(tmp_path):
    out_path = str(tmp_path / "sim.json")
    data = _run_sim(out_path)
    assert set(data) == {"env", "rows", "not_run"}
    assert data["env"]["complete"] is True
    sizes = options.size_list(64, 4 * MiB, 16)
    # nccl (here gloo) is measured for every case, in both modes, checked correct, slowest rank kept
    nccl = [r for r in data["rows"] if r["backend"] == "nccl"]
    assert len(nccl) == len(vocabulary.OPS) * 2 * len(sizes) * 2
    assert all(r["correct"] is True for r in nccl)
    assert {r["median_us"] for r in nccl if r["mode"] == "graph"} == {6.0}
    assert all("algbw_gbps" in r for r in nccl if r["bytes_per_rank"] >= MiB)
    assert not any("algbw_gbps" in r for r in nccl if r["bytes_per_rank"] < MiB)
    # every other backend is "not run" with a reason, for every case
    nr = data["not_run"]
    for b in vocabulary.BACKENDS[1:]:
        mine = [e for e in nr if e["backend"] == b]
        assert len(mine) == len(vocabulary.OPS) * 2 * len(sizes), b
        assert all(e["why"] for e in mine)
    assert any("register_mem_pool" in e["why"] for e in nr if e["backend"] == "nccl_window")
    assert any("custom path disabled" in e["why"] for e in nr if e["backend"] == "tpcomm")
    assert data["env"]["peer_copy_gbps"] is None and "not measured" in data["env"]["peer_copy"]
    assert isinstance(data["env"].get("nccl_kernels"), dict)
    tables.format_tables(data)
    tables.format_not_run(nr)
    if _has_matplotlib():
        from tpcomm.bench import plots

        assert plots.render(data, str(tmp_path / "sim"))


def _has_matplotlib():
    import importlib

    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True


def test_fake_rows_through_every_output_path(tmp_path, capsys):
    """The table, not-run list, summary, JSON and figures of a fake run, as
    the spawner prints them after a failure."""
    data = fake_results()
    path = str(tmp_path / "fake.json")
    results_file.write_json(path, data)
    from tpcomm.bench import __main__ as cli

    cli.make_plots(path)
    out = capsys.readouterr().out
    if _has_matplotlib():
        assert out.count("wrote ") == 2 * len(vocabulary.OPS) + 1
    else:
        assert "no figures" in out
    assert not math.isnan(results_file.read_json(path)["rows"][0]["median_us"])


# ------------------------------- the spawner's handling of failing ranks
def _fake_rank(rank, world, port, args, queue):
    """Stands in for worker.spawned_worker; args.ops_per_graph picks the behaviour."""
    import time

    kind = {1: "ok", 2: "raise", 3: "hang", 4: "crash_after", 5: "sigterm"}[args.ops_per_graph]
    data = fake_results()
    if rank == 0:
        queue.put(args.out)
        data["env"]["complete"] = kind in ("ok", "crash_after")
        if kind == "raise":
            data["rows"] = data["rows"][:20]
        results_file.write_json(args.out, data)
    if kind == "raise" and rank == 1:
        raise RuntimeError("simulated failure in rank 1")
    if kind == "hang":
        time.sleep(600)
    if kind == "sigterm":  # an outer `timeout` stopping the command
        if rank == 0:
            time.sleep(1.0)
            os.kill(os.getppid(), 15)
        time.sleep(600)
    if kind == "crash_after":  # the way a crash in interpreter teardown looks, after the results are written
        deadline = time.monotonic() + 60
        while not os.path.exists(args.out) and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(3)


@pytest.mark.parametrize("kind,code,expect", [
    (1, 0, "took"),
    (2, 1, "simulated failure in rank 1"),
    (3, 1, "were stopped"),
    (4, 0, "are complete"),
    (5, 1, "stopped by SIGTERM"),
])
def test_spawner_reports_and_keeps_partial_results(tmp_path, capsys, kind, code, expect):
    from tpcomm.bench import __main__ as cli

    out = str(tmp_path / "r.json")
    # the ranks must start (import torch) well within the deadline, on a loaded machine too; only the
    # hanging ranks (kind 3) wait it out
    deadline = 25 if kind == 3 else 240
    args = cli.parse_args(["--out", out, "--ops-per-graph", str(kind), "--deadline-s", str(deadline), "--no-plots"])
    rc = cli.spawn(2, args, target=_fake_rank)
    text = capsys.readouterr().out
    assert rc == code, text
    assert expect in text
    if kind == 2:
        assert "partial results (20 rows)" in text and "all_reduce bfloat16 graph" in text
    if kind in (3, 5):
        assert "partial results" in text
    assert os.path.exists(out)


# ------------------------------------------- NCCL with graph mixing off
def test_nomix_backends_run_first_in_their_own_processes(monkeypatch, tmp_path):
    """python -m tpcomm.bench runs nccl_nomix / nccl_window_nomix in a first
    set of processes with NCCL_GRAPH_MIXING_SUPPORT=0 (graph mode only), then
    the rest, whose rank 0 merges those rows; the variable is restored."""
    from tpcomm.bench import __main__ as cli

    calls = []

    def fake_spawn(n, args, target=None):
        merge = getattr(args, "merge_from", None)
        calls.append({"backends": args.backends, "modes": args.modes, "quiet": getattr(args, "quiet", False),
                      "mixing": os.environ.get("NCCL_GRAPH_MIXING_SUPPORT"),
                      "merge_exists": bool(merge) and os.path.exists(merge)})
        if getattr(args, "quiet", False):
            with open(args.out, "w") as f:
                json.dump({"env": {"complete": True}, "rows": [], "not_run": []}, f)
        return 0

    monkeypatch.setattr(cli, "spawn", fake_spawn)
    monkeypatch.delenv("NCCL_GRAPH_MIXING_SUPPORT", raising=False)
    assert cli.spawn_with_nomix(2, cli.parse_args(["--out", str(tmp_path / "r.json")])) == 0
    first, second = calls
    assert first == {"backends": "nccl_nomix,nccl_window_nomix", "modes": "graph", "quiet": True, "mixing": "0",
                     "merge_exists": False}
    assert second["mixing"] is None and second["merge_exists"] and not second["quiet"]
    assert set(second["backends"].split(",")) == set(vocabulary.BACKENDS) - set(vocabulary.NOMIX_BACKENDS)
    assert "NCCL_GRAPH_MIXING_SUPPORT" not in os.environ
    calls.clear()
    cli.spawn_with_nomix(2, cli.parse_args(["--backends", "nccl,tpcomm"]))
    cli.spawn_with_nomix(2, cli.parse_args(["--modes", "eager"]))
    assert [c["backends"] for c in calls] == ["nccl,tpcomm", None] and not any(c["quiet"] for c in calls)


def test_best_nccl_is_the_reference_of_the_tables():
    data = fake_results()
    text = tables.format_tables(data)
    assert "x = best nccl* / tpcomm" in text
    # fake speeds: nccl_window_nomix 0.4 is the fastest NCCL, tpcomm 0.3: x = 1.33 everywhere
    first_row = [line for line in text.splitlines() if line.strip().startswith("64 B")][0]
    assert first_row.split()[-1] == "1.33", first_row
    assert "tpcomm over the best NCCL measured" in tables.format_summary(data)


def test_merged_rows_of_the_nomix_run_land_in_the_results(tmp_path):
    merge_path = str(tmp_path / "nomix.json")
    merged_row = _row("all_reduce", "nccl_nomix", "bfloat16", 64, "graph", 3.25)
    with open(merge_path, "w") as f:
        json.dump({"env": {"complete": True, "elapsed_s": 1.0, "backends": {"nccl_nomix": "help"}},
                   "rows": [merged_row], "not_run": []}, f)
    out_path = str(tmp_path / "sim.json")
    data = _run_sim(out_path, merge_path)
    mine = [r for r in data["rows"] if r["backend"] == "nccl_nomix"]
    assert [(r["op"], r["bytes_per_rank"], r["median_us"]) for r in mine] == [("all_reduce", 64, 3.25)]
    assert data["env"]["merged_run"]["backends"] == ["nccl_nomix"]
    assert data["env"]["merged_run"]["env"] == "NCCL_GRAPH_MIXING_SUPPORT=0"


def test_dispatcher_is_checked_against_the_fastest_backend():
    """The summary counts the dispatcher's rows within 5 % of the fastest
    other backend of the same op, dtype and size, and names the rest and the
    sizes where the dispatcher has no row."""
    def row(backend, nbytes, us, **extra):
        return {"op": "all_reduce", "backend": backend, "dtype": "bfloat16", "bytes_per_rank": nbytes,
                "mode": "graph", "median_us": us, "correct": True, **extra}
    rows = [row("nccl", 64, 3.0), row("tpcomm_packet", 64, 2.0), row("tpcomm", 64, 2.08, route="packet"),
            row("symm_two_shot", 4 * MiB, 20.0), row("tpcomm", 4 * MiB, 25.0, route="bulk"),
            row("nccl", 64 * MiB, 250.0),
            row("tpcomm_packet", 256, 2.0), row("tpcomm", 256, 1.0, correct=False),  # a wrong row never counts
            row("tpcomm_packet", 1024, 2.0), row("tpcomm", 1024, 2.2, route="packet"),  # its own kernel, timed again
            row("tpcomm_bulk", 2048, 2.0), row("tpcomm", 2048, 2.2, route="packet")]  # another kernel: slower
    checked = tables.dispatcher_vs_fastest(rows)
    assert [(c[2], c[5], c[7]) for c in checked] == [(64, "tpcomm_packet", pytest.approx(1.04)),
                                                   (256, "tpcomm_packet", None),
                                                   (1024, "tpcomm_packet", pytest.approx(1.1)),
                                                   (2048, "tpcomm_bulk", pytest.approx(1.1)),
                                                   (4 * MiB, "symm_two_shot", pytest.approx(1.25)),
                                                   (64 * MiB, "nccl", None)]
    text = tables.format_dispatcher_check(rows)
    assert text.startswith("dispatcher within 5 % of the fastest backend, all_reduce graph: 1 of 6 dtype x size rows; "
                           "1 more routed to the fastest backend's own kernel (one kernel timed twice: bf16 1 KiB 1.10x)")
    assert ("slower: bf16 2 KiB 2.20 us (packet) vs tpcomm_bulk 2.00 (1.10x), "
            "bf16 4 MiB 25.00 us (bulk) vs symm_two_shot 20.00 (1.25x)") in text
    assert "no dispatcher row: bf16 256 B, bf16 64 MiB" in text
    assert text in tables.format_summary({"rows": rows})
