"""tpcomm.bench and tpcomm.tune know the quantized all-reduce, without a GPU:
its benchmark backends (one a mode, all_reduce of float16/bfloat16 only,
checked against the error bound, not bit for bit: 2-process gloo runs with
the kernel stood in for by its reference and by a result past the bound),
the dispatcher check that leaves them out, and the "quantized_min_bytes"
tune derives from a run (the smallest size from which every mode beats the
exact backends) and writes where the Communicator's routing reads it."""
import json

import pytest
import torch

from multiproc import run_ranks
from tpcomm import _constants as C
from tpcomm import quantized_reference, routing, routing_table, tune
from tpcomm.bench import cases, tables, vocabulary
from tpcomm.bench.inputs import make_input

KiB, MiB = 1024, 1024 * 1024
QB = ("tpcomm_quantized_fp8", "tpcomm_quantized_int8", "tpcomm_quantized_int4")


def _row(size, backend, us, op="all_reduce", dtype="bfloat16", mode="graph", correct=True):
    return {"op": op, "backend": backend, "dtype": dtype, "bytes_per_rank": size, "mode": mode,
            "median_us": us, "correct": correct}


def test_backends_are_listed_and_described():
    assert cases.QUANTIZED_BACKENDS == QB
    for b in QB:
        assert b in vocabulary.BACKENDS and b in cases.TPCOMM_BACKENDS and "error bound" in vocabulary.BACKEND_HELP[b]
        assert b not in tune.ROUTABLE  # timed, never a band's backend
    assert tune.QUANTIZED == QB


def _run(sizes, exact, quant):
    """Rows: bulk at `exact` us and each quantized mode at quant[mode] us per size."""
    rows = [_row(s, "tpcomm_bulk", t) for s, t in zip(sizes, exact)]
    for b, ts in quant.items():
        rows += [_row(s, b, t) for s, t in zip(sizes, ts)]
    return rows


def test_quantized_minimum():
    sizes = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
    exact = (10.0, 20.0, 60.0, 200.0)
    # every mode faster from 4 MiB on; fp8 not yet at 1 MiB where int4 is
    rows = _run(sizes, exact, {QB[0]: (12, 21, 40, 120), QB[1]: (12, 19, 41, 121), QB[2]: (11, 15, 30, 90)})
    assert tune.quantized_minimum(rows) == 4 * MiB
    # a win at 256 KiB, a loss at 1 MiB: the minimum is past the loss
    rows = _run(sizes, exact, {QB[1]: (9, 25, 40, 120)})
    assert tune.quantized_minimum(rows) == 4 * MiB
    # wins everywhere, one mode measured
    assert tune.quantized_minimum(_run(sizes, exact, {QB[2]: (1, 1, 1, 1)})) == 256 * KiB
    # never a win at the largest size: never
    assert tune.quantized_minimum(_run(sizes, exact, {QB[1]: (1, 1, 1, 300)})) == tune.QUANTIZED_NEVER
    # incorrect, eager and other-dtype rows do not count; nothing quantized measured: None
    rows = _run(sizes, exact, {}) + [_row(1 * MiB, QB[1], 1.0, correct=False), _row(1 * MiB, QB[1], 1.0, mode="eager"),
                                     _row(1 * MiB, QB[1], 1.0, dtype="float16")]
    assert tune.quantized_minimum(rows) is None
    # a faster but incorrect exact row is no competitor
    rows = _run(sizes, exact, {QB[0]: (5, 5, 5, 5)}) + [_row(s, "nccl", 0.1, correct=False) for s in sizes]
    assert tune.quantized_minimum(rows) == 256 * KiB


def test_derived_table_carries_the_world_sizes_minimum(tmp_path):
    sizes = (256 * KiB, 1 * MiB, 4 * MiB)
    rows = _run(sizes, (10.0, 20.0, 60.0), {QB[1]: (12, 15, 40)})
    base = {"routes": {op: {"*": {"*": [[64 * KiB, "packet"], [16 * MiB, "bulk"]]}} for op in routing.OPS},
            "quantized_min_bytes": {"2": 8 * MiB, "4": 2 * MiB}}
    table = tune.derive_table({"env": {"world_size": 4}, "rows": rows}, base=base)
    assert table["quantized_min_bytes"] == {"2": 8 * MiB, "4": 1 * MiB}  # its own world replaced, others kept
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    loaded = routing_table.load_table(str(path))
    routes = routing_table.effective_routes(loaded, 4, quantize="int8")
    caps = routing.Caps(4, 16 * MiB, 1 * MiB, C.TPC_PLATFORM_CUDA)
    assert routing.route(routes, caps, "all_reduce", torch.bfloat16, 1 * MiB) == "quantized_int8"
    assert routing.route(routes, caps, "all_reduce", torch.bfloat16, 1 * MiB - 16) == "bulk"
    # a run without quantized rows leaves the field as it was
    kept = tune.derive_table({"env": {"world_size": 4}, "rows": _run(sizes, (1, 2, 3), {})}, base=base)
    assert kept["quantized_min_bytes"] == base["quantized_min_bytes"]


def test_live_tune_asks_the_bench_for_the_quantized_backends(monkeypatch, tmp_path):
    import tpcomm.bench.__main__ as bench_main

    seen = {}

    def fake_bench(argv):
        seen["backends"] = argv[argv.index("--backends") + 1].split(",")
        return 0  # writes nothing: tune says nothing was measured

    monkeypatch.setattr(bench_main, "main", fake_bench)
    assert tune.main(["--out", str(tmp_path / "t.json")]) == 1
    assert set(QB) <= set(seen["backends"]) and "tpcomm_bulk" in seen["backends"]


def test_dispatcher_check_leaves_the_quantized_rows_out():
    rows = [_row(4 * MiB, "tpcomm", 50.0), _row(4 * MiB, "tpcomm_bulk", 49.0), _row(4 * MiB, QB[2], 10.0)]
    rows[0]["route"] = "bulk"
    (op, dtype, size, us, route, fastest, fastest_us, ratio), = tables.dispatcher_vs_fastest(rows)
    assert fastest == "tpcomm_bulk" and ratio == pytest.approx(50 / 49)


class _FakeKernels:
    """The quantized kernel stood in for: its reference's bits (within the
    bound) or those plus 1 in one value (past it)."""

    def __init__(self, broken):
        self.broken = broken

    def all_reduce(self, x, algo):
        world = torch.distributed.get_world_size()
        parts = [torch.empty_like(x) for _ in range(world)]
        torch.distributed.all_gather(parts, x)
        y = quantized_reference.emulate(parts, algo[len("quantized_"):])
        if self.broken:
            y[7] += 1.0
        return y


class _FakeComm:
    def __init__(self, broken, world):
        self.kernels = _FakeKernels(broken)
        self.caps = routing.Caps(world, 16 * MiB, 1 * MiB, C.TPC_PLATFORM_CUDA)


class _FakeResources:
    def __init__(self, world, broken=False):
        self.reasons, self.world, self.comm = {}, world, _FakeComm(broken, world)


def _body_cases(rank, world):
    x0 = make_input(rank, "all_reduce", torch.bfloat16, 4096, "cpu")
    for broken in (False, True):
        res = _FakeResources(world, broken)
        for backend in QB:
            case = cases.make_case(backend, "all_reduce", x0, res)
            assert case.check is not None
            assert case.check(case.call()) is (not broken), (backend, broken)
    res = _FakeResources(world)
    with pytest.raises(cases.Unavailable, match="all_reduce only"):
        cases.make_case(QB[0], "reduce_scatter", x0, res)
    with pytest.raises(cases.Unavailable, match="float32. is not float16 or bfloat16"):
        cases.make_case(QB[1], "all_reduce", x0.float(), res)
    with pytest.raises(cases.Unavailable, match="over max_bytes"):
        cases.make_case(QB[2], "all_reduce", torch.zeros(9 * MiB, dtype=torch.bfloat16), res)
    res.comm.caps = routing.Caps(world, 16 * MiB, 1 * MiB, C.TPC_PLATFORM_ROCM)
    with pytest.raises(cases.Unavailable, match="CUDA only"):
        cases.make_case(QB[2], "all_reduce", x0, res)


def test_bench_cases_check_against_the_bound():
    run_ranks(2, _body_cases)
