"""tpcomm.bench and tpcomm.tune know the fused all-reduce + add + RMSNorm
and its FP8 epilogues, without a GPU: the norm ops' shapes (tokens, hidden)
and their rows kept apart per hidden size in the tables, the cases on each
backend (the dispatcher, the fused kernel forced, the route past the cap)
checked against tpcomm.reference on 2-process gloo runs with the kernels
stood in for by that reference (and by a result off by a few ulps, which the
check must catch), and the "fused_norm_max_bytes" tune derives and writes."""
import types

import pytest
import torch
import torch.distributed as dist

import tpcomm
from multiproc import run_ranks
from tpcomm import _constants as C
from tpcomm import fp8, routing, routing_table, tune
from tpcomm.bench import cases, norm_cases, options, tables, vocabulary
from tpcomm.bench.__main__ import parse_args
from tpcomm.bench.inputs import make_input
from tpcomm.reference import rank_order_sum, reference_all_reduce_norm

KiB, MiB = 1024, 1024 * 1024
NORM_OPS = vocabulary.NORM_OPS


# ------------------------------------------ options, shapes and tables
def test_norm_ops_are_known_to_the_command_line():
    assert NORM_OPS[0] == "all_reduce_add_rms_norm" and all(op.startswith(NORM_OPS[0]) for op in NORM_OPS)
    assert {op: norm_cases.QUANT[op] for op in NORM_OPS} == {
        NORM_OPS[0]: None, NORM_OPS[1]: "per_tensor", NORM_OPS[2]: "per_token", NORM_OPS[3]: "per_token_group"}
    args = parse_args(["--ops", ",".join(NORM_OPS), "--hidden", "4096,8192", "--backends",
                       "tpcomm,tpcomm_fused,tpcomm_past_cap"])
    assert args.hidden == "4096,8192"
    assert parse_args([]).hidden == vocabulary.NORM_HIDDEN == "4096,8192"
    for b in norm_cases.NORM_BACKENDS:
        assert b in vocabulary.BACKENDS and b in cases.TPCOMM_BACKENDS and "norm ops only" in vocabulary.BACKEND_HELP[b]
        assert b not in tune.ROUTABLE  # timed, never a band's backend
    with pytest.raises(SystemExit):
        parse_args(["--hidden", "4096,-1"])
    with pytest.raises(ValueError, match="positive integers"):
        options.parse_hidden("wide")


def test_norm_shapes_sweep_tokens_per_hidden_size():
    sizes = options.size_list(64, 64 * MiB, 4)
    got = options.shapes(NORM_OPS[0], 2, sizes, 8, [4096, 8192])
    assert [s for s in got if s[1] == 4096] == [(t, 4096) for t in (1, 2, 8, 32, 128, 512, 2048, 8192)]
    assert [s for s in got if s[1] == 8192] == [(t, 8192) for t in (1, 4, 16, 64, 256, 1024, 4096)]
    # the collectives keep their sizes: reduce_scatter in world equal parts
    assert options.shapes("all_reduce", 2, [64, 1000], 3, [4096]) == [(32,), (500,)]
    assert options.shapes("reduce_scatter", 2, [64, 1000], 3, [4096]) == [(30,), (498,)]


def _row(size, backend, us, op=NORM_OPS[0], hidden=4096, dtype="bfloat16", mode="graph", correct=True, **more):
    return {"op": op, "backend": backend, "dtype": dtype, "bytes_per_rank": size, "mode": mode, "median_us": us,
            "correct": correct, "hidden": hidden, **more}


def test_tables_keep_the_hidden_sizes_apart():
    rows = [_row(64 * KiB, b, t, hidden=h) for h in (4096, 8192) for b, t in (("tpcomm_fused", 5.0),
                                                                          ("tpcomm_past_cap", 9.0 + h / 4096))]
    rows.append(_row(64 * KiB, "tpcomm", 5.1, route="fused"))
    not_run = [{"op": NORM_OPS[0], "backend": "nccl", "dtype": "bfloat16", "bytes_per_rank": 64 * KiB,
                "hidden": 8192, "why": "the fused norm ops run on tpcomm only"}]
    data = {"env": {}, "rows": rows, "not_run": not_run}
    text = tables.format_tables(data)
    assert text.count("median us per op") == 2
    assert "all_reduce_add_rms_norm_h4096 bfloat16 graph" in text and "all_reduce_add_rms_norm_h8192" in text
    assert "10.00" in text and "11.00" in text  # both hidden sizes' rows, neither overwriting the other
    assert "all_reduce_add_rms_norm_h8192 nccl [bf16] 64 KiB: the fused norm ops" in tables.format_not_run(not_run)
    # the dispatcher check: routed to the fused kernel, within 5 % of it
    (op, _, _, us, route, fastest, _, ratio), = [c for c in tables.dispatcher_vs_fastest(rows)
                                                 if c[0].endswith("h4096")]
    assert (route, fastest) == ("fused", "tpcomm_fused") and ratio == pytest.approx(5.1 / 5.0)
    assert "dispatcher within 5 %" in tables.format_summary(data)


# ------------------------------------------------------------------ tune
def _pairs(sizes, fused, past, **kw):
    return ([_row(s, "tpcomm_fused", t, **kw) for s, t in zip(sizes, fused)]
            + [_row(s, "tpcomm_past_cap", t, **kw) for s, t in zip(sizes, past)])


SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)


def test_fused_norm_maximum():
    # never lost: the largest size measured, no further
    assert tune.fused_norm_maximum(_pairs(SIZES, (1, 2, 3, 4), (2, 3, 4, 5))) == 4 * MiB
    assert tune.fused_norm_maximum(_pairs(SIZES, (1, 2, 3, 4), (1, 2, 3, 4))) == 4 * MiB  # ties go to fused
    assert tune.fused_norm_maximum(_pairs(SIZES, (1, 2, 5, 4), (2, 3, 4, 5))) == 256 * KiB  # lost at 1 MiB
    assert tune.fused_norm_maximum(_pairs(SIZES, (3, 2, 3, 4), (2, 3, 4, 5))) == tune.FUSED_NORM_NEVER
    # every op and hidden size counts: an FP8 epilogue losing at 256 KiB at hidden 8192 caps them all
    rows = _pairs(SIZES, (1, 2, 3, 4), (2, 3, 4, 5)) + _pairs(SIZES, (1, 4, 3, 4), (2, 3, 4, 5), op=NORM_OPS[3],
                                                               hidden=8192)
    assert tune.fused_norm_maximum(rows) == 64 * KiB
    # eager and float16 rows do not count, nor sizes measured on one backend only, nor a past-cap row
    # that failed its check
    rows = (_pairs(SIZES[:2], (1, 2), (2, 3)) + [_row(1 * MiB, "tpcomm_fused", 9.0)]
            + _pairs((4 * MiB,), (9,), (1,), mode="eager") + _pairs((4 * MiB,), (9,), (1,), dtype="float16")
            + [_row(4 * MiB, "tpcomm_fused", 9.0), _row(4 * MiB, "tpcomm_past_cap", 1.0, correct=False)])
    assert tune.fused_norm_maximum(rows) == 256 * KiB
    # a fused row that failed its check lost, however fast
    rows = _pairs(SIZES, (1, 2, 3, 4), (2, 3, 4, 5))
    rows[2]["correct"] = False
    assert tune.fused_norm_maximum(rows) == 256 * KiB
    assert tune.fused_norm_maximum([_row(64, "tpcomm_fused", 1.0)]) is None
    assert tune.fused_norm_maximum([]) is None


def test_derived_table_carries_the_world_sizes_cap(tmp_path):
    base = {"routes": {op: {"*": {"*": [[64 * KiB, "packet"], [16 * MiB, "bulk"]]}} for op in routing.OPS},
            "quantized_min_bytes": {"4": 2 * MiB}, "fused_norm_max_bytes": {"2": 4 * MiB, "8": 128 * KiB}}
    rows = _pairs(SIZES, (1, 2, 5, 4), (2, 3, 4, 5))
    table = tune.derive_table({"env": {"world_size": 4}, "rows": rows}, base=base)
    assert table["fused_norm_max_bytes"] == {"2": 4 * MiB, "4": 256 * KiB, "8": 128 * KiB}  # its own world only
    assert table["quantized_min_bytes"] == {"4": 2 * MiB}  # beside it, untouched
    assert "fused_norm_max_bytes measured at world size 2, 4, 8" in table["about"]
    path = tmp_path / "t.json"
    tune_out = tune.main(["--from", _write(tmp_path / "run.json", {"env": {"world_size": 4}, "rows": rows}),
                          "--out", str(path)])
    assert tune_out == 0
    routes = routing_table.effective_routes(routing_table.load_table(str(path)), 4)
    assert routes["all_reduce"]["fused_norm"] == [(256 * KiB, "fused")]  # the table's, not the cost model's
    caps = routing.Caps(4, 16 * MiB, 1 * MiB, C.TPC_PLATFORM_CUDA)
    assert routing.add_rms_norm(routes, caps, True, torch.bfloat16, torch.bfloat16, 256 * KiB, 8 * KiB) == "fused"
    assert routing.add_rms_norm(routes, caps, True, torch.bfloat16, torch.bfloat16, 320 * KiB, 8 * KiB) == "split"
    # a run without the norm rows leaves the field as it was, and says so where no world has one
    kept = tune.derive_table({"env": {"world_size": 4}, "rows": []}, base=base)
    assert kept["fused_norm_max_bytes"] == base["fused_norm_max_bytes"]
    bare = tune.derive_table({"env": {"world_size": 4}, "rows": []}, base={"routes": base["routes"]})
    assert "fused_norm_max_bytes" not in bare and "the cost-model default" in bare["about"]


def _write(path, data):
    import json

    path.write_text(json.dumps(data))
    return str(path)


def test_live_tune_asks_the_bench_for_the_norm_ops(monkeypatch, tmp_path):
    import tpcomm.bench.__main__ as bench_main

    seen = {}

    def fake_bench(argv):
        seen["backends"] = argv[argv.index("--backends") + 1].split(",")
        seen["ops"] = argv[argv.index("--ops") + 1].split(",")
        return 0

    monkeypatch.setattr(bench_main, "main", fake_bench)
    assert tune.main(["--out", str(tmp_path / "t.json")]) == 1
    assert {"tpcomm_fused", "tpcomm_past_cap"} <= set(seen["backends"])
    assert set(vocabulary.ALL_OPS) == set(seen["ops"])


# ------------------------------------------------------------ the cases
class _GlooKernels:
    """tpcomm's kernels stood in for over gloo by the reference's math;
    broken: the normed output 3 ulps off and one FP8 code changed."""

    def __init__(self, broken=False):
        self.broken, self.ran = broken, []

    def _every(self, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return parts

    def all_reduce_runner(self, dtype, algo):
        def run(x, out=None):
            self.ran.append(("all_reduce", algo))
            y = rank_order_sum(self._every(x)).to(x.dtype)
            return y if out is None else out.copy_(y)
        return run

    def all_gather(self, x, dim, algo):
        self.ran.append(("all_gather", algo))
        return torch.cat(self._every(x), dim)

    def reduce_scatter_f32(self, parts, algo):
        self.ran.append(("reduce_scatter_f32", algo))
        return rank_order_sum(self._every(parts)).chunk(dist.get_world_size())[dist.get_rank()].contiguous()

    def _norm(self, pattern, x, residual, weight, next_weight, eps, next_eps, offset, **vectors):
        normed, stream = reference_all_reduce_norm(self._every(x), residual, weight, eps, pattern, offset,
                                                   next_weight, next_eps, **vectors)  # bias, next_bias, residual_scale
        if self.broken:
            normed = (normed.view(torch.int16) + 3).view(normed.dtype)
        return normed, stream

    def all_reduce_norm(self, pattern, x, residual, weight, next_weight, eps, next_eps, offset, normed, stream_out,
                        bias=None, next_bias=None, residual_scale=1.0):
        self.ran.append(("fused", None))
        n, s = self._norm(pattern, x, residual, weight, next_weight, eps, next_eps, offset, bias=bias,
                          next_bias=next_bias, residual_scale=residual_scale)
        normed.copy_(n)
        stream_out.copy_(s)

    def all_reduce_norm_quant(self, pattern, quant, x, residual, weight, next_weight, eps, next_eps, offset, floor,
                              normed, stream_out, codes, scales, bias=None, next_bias=None, residual_scale=1.0):
        self.ran.append(("fused", quant))
        n, s = reference_all_reduce_norm(self._every(x), residual, weight, eps, pattern, offset, next_weight,
                                         next_eps, bias=bias, next_bias=next_bias, residual_scale=residual_scale)
        c, sc = fp8.quantize_checked(n, quant, scales if quant == fp8.Quant.PER_TENSOR else None, floor, False)
        if self.broken:
            c.view(torch.uint8).view(-1)[5] ^= 1
        if normed is not None:
            normed.copy_(n)
        stream_out.copy_(s)
        codes.copy_(c)
        scales.copy_(sc)


def _resources(world, broken=False, platform=C.TPC_PLATFORM_CUDA):
    comm = tpcomm.Communicator(device="cpu")
    comm._caps = routing.Caps(world, comm.max_bytes, comm.packet_max_bytes, platform)
    comm._kernels = _GlooKernels(broken)
    comm.platform = platform
    for memo in comm._memo.values():
        memo.clear()
    return types.SimpleNamespace(reasons={}, world=world, comm=comm)


def _x0(rank, shape, dtype=torch.bfloat16):
    return make_input(rank, NORM_OPS[0], dtype, shape[0] * shape[1], "cpu").view(shape)


def _body_cases(rank, world):
    res = _resources(world)
    routes = {}
    for op in NORM_OPS:
        for backend in ("tpcomm", "tpcomm_fused", "tpcomm_past_cap"):
            for rows in (4, 3):  # 4 rows divide among 2 ranks (split), 3 do not
                case = cases.make_case(backend, op, _x0(rank, (rows, 256)), res)
                res.comm._kernels.ran.clear()
                case.prepare()
                out = case.call()
                assert case.check(out), (op, backend, rows)
                routes[op, backend, rows] = case.route
                ran = {name for name, _ in res.comm._kernels.ran}
                assert ran == {"fused": {"fused"}, "split": {"reduce_scatter_f32", "all_gather"},
                               "unfused": {"all_reduce"}}[case.route], (op, backend, rows, ran)
    for op in NORM_OPS:
        for rows in (4, 3):
            assert routes[op, "tpcomm", rows] == routes[op, "tpcomm_fused", rows] == "fused"  # 2 ranks: no cap
        assert routes[op, "tpcomm_past_cap", 3] == "unfused"
        assert routes[op, "tpcomm_past_cap", 4] == ("split" if op == NORM_OPS[0] else "unfused")
    # a kernel off by 3 ulps in the normed output, or one FP8 code: the check says so
    broken = _resources(world, broken=True)
    for op in NORM_OPS:
        case = cases.make_case("tpcomm_fused", op, _x0(rank, (4, 256)), broken)
        assert not case.check(case.call()), op
    # what the cases decline, with the reason
    with pytest.raises(cases.Unavailable, match="norm ops run on tpcomm, tpcomm_fused, tpcomm_past_cap only"):
        cases.make_case("nccl", NORM_OPS[0], _x0(rank, (4, 256)), res)
    with pytest.raises(cases.Unavailable, match="float16 and bfloat16, not torch.float32"):
        cases.make_case("tpcomm_fused", NORM_OPS[0], _x0(rank, (4, 256), torch.float32), res)
    with pytest.raises(cases.Unavailable, match="the fused norm ops only"):
        cases.make_case("tpcomm_fused", "all_reduce", make_input(rank, "all_reduce", torch.bfloat16, 64, "cpu"), res)
    with pytest.raises(cases.Unavailable, match="a row of 65536 bytes: the packet kernel needs .* up to 32768"):
        cases.make_case("tpcomm_fused", NORM_OPS[2], _x0(rank, (2, 32768)), res)
    rocm = _resources(world, platform=C.TPC_PLATFORM_ROCM)
    with pytest.raises(cases.Unavailable, match="no FP8 epilogues in this build"):
        cases.make_case("tpcomm_fused", NORM_OPS[1], _x0(rank, (4, 256)), rocm)
    assert cases.make_case("tpcomm_fused", NORM_OPS[0], _x0(rank, (4, 256)), rocm).route == "fused"
    for r in (res, broken, rocm):
        r.comm.close()


def test_norm_cases_run_each_route_and_check_against_the_reference():
    run_ranks(2, _body_cases)


def _sim_rank(rank, world, out_path):
    """One rank of the measurement loop on the norm ops, CPU: the custom
    path faked open (_GlooKernels), CUDA calls and timers faked, the
    collectives real (gloo)."""
    from tpcomm.bench import __main__ as cli, worker

    torch.cuda.synchronize = lambda *a, **k: None
    cases.Resources._setup_tpcomm = lambda self: setattr(self, "comm", _resources(world).comm)

    def fake_graphs(calls, ops, reps, settle=0):
        for call in calls:
            call()
        return [(5.0, None) for _ in calls]

    worker.time_graphs = fake_graphs
    worker.time_eager = lambda call, ops, reps: call() and 9.0
    args = cli.parse_args(["--ops", f"all_reduce,{NORM_OPS[0]},{NORM_OPS[3]}", "--hidden", "256,512",
                           "--max-bytes", str(64 * KiB), "--sizes-step", "16", "--dtypes", "bf16,fp32",
                           "--backends", "nccl,tpcomm,tpcomm_fused,tpcomm_past_cap", "--out", out_path,
                           "--no-progress"])
    worker._run(rank, world, torch.device("cpu"), args, None)


def test_measurement_loop_runs_the_norm_cases(tmp_path):
    import json

    out_path = str(tmp_path / "sim.json")
    run_ranks(2, _sim_rank, out_path, timeout=240)
    with open(out_path) as f:
        data = json.load(f)
    norm = [r for r in data["rows"] if r["op"] in NORM_OPS]
    shapes = {(r["bytes_per_rank"] // (2 * r["hidden"]), r["hidden"]) for r in norm}
    assert shapes == {(1, 256), (2, 256), (32, 256), (128, 256), (1, 512), (16, 512), (64, 512)}
    assert {(r["op"], r["backend"], r["mode"]) for r in norm} == {
        (op, b, m) for op in (NORM_OPS[0], NORM_OPS[3]) for b in ("tpcomm", "tpcomm_fused", "tpcomm_past_cap")
        for m in ("graph", "eager")}
    assert all(r["correct"] is True and r["dtype"] == "bfloat16" for r in norm)
    assert {r["route"] for r in norm if r["backend"] == "tpcomm_past_cap"} == {"split", "unfused"}
    assert {r["route"] for r in norm if r["backend"] != "tpcomm_past_cap"} == {"fused"}
    # the collectives' rows as before; nccl and float32 are no norm backend, with the reason
    assert {r["op"] for r in data["rows"]} == {"all_reduce", NORM_OPS[0], NORM_OPS[3]}
    nr = [e for e in data["not_run"] if e["op"] in NORM_OPS]
    assert {e["backend"] for e in nr if e["dtype"] == "bfloat16"} == {"nccl"}
    assert all("hidden" in e and e["why"] for e in nr)
    assert "all_reduce_add_rms_norm_h512 bfloat16 graph" in tables.format_tables(data)
    assert tune.fused_norm_maximum(data["rows"]) == 64 * KiB  # equal fake times: the fused kernel, to the largest size


def test_ranks_share_a_gpu_over_gloo_only_when_asked(monkeypatch):
    from tpcomm import _testing
    from tpcomm.bench import worker

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("TPCOMM_SHARE_GPU", raising=False)
    assert worker.placement(1, 2) == (torch.device("cuda", 1), "nccl")  # set_device then says why
    monkeypatch.setattr(_testing, "_shared_gpu", False)
    monkeypatch.setenv("TPCOMM_SHARE_GPU", "1")
    assert worker.placement(1, 2) == (torch.device("cuda", 0), "gloo") and _testing.shared_gpu_allowed()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert worker.placement(1, 2) == (torch.device("cuda", 1), "nccl")  # enough GPUs: one each, NCCL
