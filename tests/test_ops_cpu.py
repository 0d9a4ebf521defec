"""The built extension without a GPU: the internal ops' registration and
schemas, their fake (meta) implementations, the C API through ctypes, the
routing tables, and the eager all_reduce's paths."""
import contextlib
import ctypes
import os
import re
import shutil
import subprocess

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tpcomm
from tpcomm import _constants, _lib, _testing, routing, routing_table
from tpcomm.backends import kernels as kernels_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KiB = 1024
MiB = 1024 * KiB

SCHEMAS = {
    "all_reduce": "_tpcomm::all_reduce(Tensor input, int comm_id, int algo) -> Tensor",
    "all_reduce_out": "_tpcomm::all_reduce_out(Tensor input, Tensor(a!) out, int comm_id, int algo) -> ()",
    "all_gather": "_tpcomm::all_gather(Tensor input, int dim, int comm_id, int algo) -> Tensor",
    "reduce_scatter": "_tpcomm::reduce_scatter(Tensor input, int comm_id, int algo) -> Tensor",
    "reduce_scatter_f32": "_tpcomm::reduce_scatter_f32(Tensor input, int comm_id, int algo) -> Tensor",
    "all_reduce_norm_out": "_tpcomm::all_reduce_norm_out(Tensor input, Tensor residual, Tensor? weight, "
                           "Tensor? next_weight, float eps, float next_eps, float weight_offset, int pattern, "
                           "Tensor(a!) normed, Tensor(b!) stream_out, int comm_id, Tensor? bias=None, "
                           "Tensor? next_bias=None, float residual_scale=1.) -> ()",
    "all_reduce_norm_quant_out": "_tpcomm::all_reduce_norm_quant_out(Tensor input, Tensor residual, Tensor? weight, "
                                 "Tensor? next_weight, float eps, float next_eps, float weight_offset, int pattern, "
                                 "int quant, float scale_floor, Tensor(a!)? normed, Tensor(b!) stream_out, "
                                 "Tensor(c!) codes, Tensor(d!) scales, int comm_id, Tensor? bias=None, "
                                 "Tensor? next_bias=None, float residual_scale=1.) -> ()",
}
P, L, B = _lib.ALGO_PACKET, _lib.ALGO_LINE, _lib.ALGO_BULK


@pytest.fixture(scope="module")
def lib():
    return tpcomm.load()


@pytest.fixture
def handle():
    """handle(world_size): the id of a made-up open communicator the fake ops
    find in tpcomm._registry (removed after the test)."""
    with contextlib.ExitStack() as stack:
        yield lambda world_size: stack.enter_context(_testing.stand_in(world_size)).comm_id


# ---------------------------------------------------------------- loading

def test_extension_loads(lib):
    assert isinstance(lib, ctypes.CDLL)
    assert tpcomm.load() is lib  # loaded once
    path = _lib.library_path()
    assert path.endswith(".so") and "_C" in path
    for name in SCHEMAS:
        assert hasattr(torch.ops._tpcomm, name)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_op_schema(lib, name):
    schema = getattr(torch.ops._tpcomm, name).default._schema
    assert str(schema) == SCHEMAS[name]


def test_out_is_mutable_and_nothing_else(lib):
    out_schema = torch.ops._tpcomm.all_reduce_out.default._schema
    assert out_schema.arguments[1].name == "out"
    assert out_schema.arguments[1].alias_info is not None
    assert out_schema.arguments[1].alias_info.is_write
    assert out_schema.arguments[0].alias_info is None  # input is only read
    for name in ("all_reduce", "all_gather"):
        schema = getattr(torch.ops._tpcomm, name).default._schema
        assert all(a.alias_info is None for a in schema.arguments), name
        assert not schema.is_mutable


CPU_CALLS = {
    "all_reduce": lambda x, h: torch.ops._tpcomm.all_reduce(x, h, P),
    "all_reduce_out": lambda x, h: torch.ops._tpcomm.all_reduce_out(x, torch.empty_like(x), h, P),
    "all_gather": lambda x, h: torch.ops._tpcomm.all_gather(x, 0, h, P),
    "reduce_scatter": lambda x, h: torch.ops._tpcomm.reduce_scatter(x, h, P),
    "reduce_scatter_f32": lambda x, h: torch.ops._tpcomm.reduce_scatter_f32(x, h, P),
    "all_reduce_norm_out": lambda x, h: torch.ops._tpcomm.all_reduce_norm_out(
        x, x, x, None, 1e-6, 1e-6, 0.0, 0, torch.empty_like(x), torch.empty_like(x), h),
    "all_reduce_norm_quant_out": lambda x, h: torch.ops._tpcomm.all_reduce_norm_quant_out(
        x, x, x, None, 1e-6, 1e-6, 0.0, 0, 2, 1e-6, None, torch.empty_like(x),
        torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(1), h),
}


@pytest.mark.parametrize("name", sorted(CPU_CALLS))
def test_ops_refuse_cpu_tensors_with_their_own_message(lib, handle, name):
    """A CPU tensor gets tpcomm's one-line message, not the dispatcher's list of backends."""
    with pytest.raises(RuntimeError) as caught:
        CPU_CALLS[name](torch.zeros(16), handle(2))
    assert not isinstance(caught.value, NotImplementedError)
    assert str(caught.value) == f"tpcomm: _tpcomm::{name} needs CUDA tensors, got a cpu tensor"


# ------------------------------------------------------------- fake impls

@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_fake_all_gather_shapes(lib, handle, world_size, dtype):
    h = handle(world_size)
    with FakeTensorMode():
        x2 = torch.empty(3, 5, device="cuda", dtype=dtype)
        x3 = torch.empty(2, 3, 7, device="cuda", dtype=dtype)
        cases = [
            (x2, 0, (3 * world_size, 5)),
            (x2, 1, (3, 5 * world_size)),
            (x2, -1, (3, 5 * world_size)),
            (x2, -2, (3 * world_size, 5)),
            (x3, 0, (2 * world_size, 3, 7)),
            (x3, 1, (2, 3 * world_size, 7)),
            (x3, -1, (2, 3, 7 * world_size)),
        ]
        for x, dim, shape in cases:
            y = torch.ops._tpcomm.all_gather(x, dim, h, P)
            assert tuple(y.shape) == shape, (x.shape, dim)
            assert y.dtype == dtype
            assert y.device.type == "cuda"
            assert y.is_contiguous()


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_fake_reduce_scatter_shapes(lib, handle, world_size):
    h = handle(world_size)
    with FakeTensorMode():
        for shape, dtype in [((world_size * 4, 8), torch.float32), ((world_size, 3, 16), torch.bfloat16)]:
            y = torch.ops._tpcomm.reduce_scatter(torch.empty(shape, device="cuda", dtype=dtype), h, P)
            assert tuple(y.shape) == (shape[0] // world_size,) + shape[1:] and y.dtype == dtype
            y = torch.ops._tpcomm.reduce_scatter_f32(torch.empty(shape, device="cuda", dtype=dtype), h, P)
            assert tuple(y.shape) == (shape[0] // world_size,) + shape[1:] and y.dtype == torch.float32
        for op in (torch.ops._tpcomm.reduce_scatter, torch.ops._tpcomm.reduce_scatter_f32):
            with pytest.raises(ValueError, match="divisible by the world size"):
                op(torch.empty(world_size + 1, device="cuda"), h, P)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_fake_all_reduce_keeps_shape_and_dtype(lib, handle, world_size):
    h = handle(world_size)
    with FakeTensorMode():
        for shape, dtype in [((4, 8), torch.float32), ((3, 5, 16), torch.bfloat16), ((64,), torch.float16)]:
            x = torch.empty(shape, device="cuda", dtype=dtype)
            y = torch.ops._tpcomm.all_reduce(x, h, P)
            assert tuple(y.shape) == shape and y.dtype == dtype and y.device == x.device
            assert y.is_contiguous()
            # a transposed input still gives a contiguous output of its shape
            xt = torch.empty(8, 4, device="cuda", dtype=dtype).t()
            yt = torch.ops._tpcomm.all_reduce(xt, h, L)
            assert tuple(yt.shape) == (4, 8) and yt.is_contiguous()
            out = torch.empty_like(x)
            assert torch.ops._tpcomm.all_reduce_out(x, out, h, B) is None


def test_fake_all_gather_errors(lib, handle):
    h = handle(2)
    with FakeTensorMode():
        x = torch.empty(3, 5, device="cuda")
        for dim in (2, -3, 7):
            with pytest.raises(IndexError, match="out of range"):
                torch.ops._tpcomm.all_gather(x, dim, h, P)
        with pytest.raises(ValueError, match="at least one dimension"):
            torch.ops._tpcomm.all_gather(torch.empty((), device="cuda"), 0, h, P)
        with pytest.raises(ValueError, match="not an open communicator"):
            torch.ops._tpcomm.all_gather(x, 0, 12345, P)


def test_fake_ops_trace_with_make_fx(lib, handle):
    """The fake impls let the ops be traced symbolically (what torch.compile needs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    h = handle(4)

    def f(x):
        y = torch.ops._tpcomm.all_reduce(x, h, P)
        return torch.ops._tpcomm.all_gather(y, -1, h, P)

    with FakeTensorMode():
        x = torch.empty(2, 8, device="cuda")
        gm = make_fx(f, tracing_mode="fake")(x)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops._tpcomm.all_reduce.default in targets
    assert torch.ops._tpcomm.all_gather.default in targets


# ---------------------------------------------------------- C API (ctypes)

def _config(rank=0, world_size=2, device=0, max_bytes=1 * MiB, packet_max_bytes=64 * KiB,
            timeout_ns=10**9):
    return _lib.Config(rank, world_size, device, max_bytes, packet_max_bytes, timeout_ns)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without a GPU")
def test_c_create_fails_without_gpu(lib):
    comm = ctypes.c_void_p(1234)
    cfg = _config()
    code = lib.tpc_comm_create(ctypes.byref(cfg), ctypes.byref(comm))
    assert code == _lib.ERR_RUNTIME == 2
    assert comm.value is None  # *comm_out is cleared
    message = lib.tpc_comm_last_error(None).decode()
    assert "failed" in message
    assert "runtime error" in message
    with pytest.raises(tpcomm.TpcommError) as info:
        _lib.check(lib, None, code, "create")
    assert info.value.code == _lib.ERR_RUNTIME
    assert "GPU runtime error" in str(info.value) and "failed" in str(info.value)


@pytest.mark.parametrize("field, value, needle", [
    ("world_size", 1, "world_size"),
    ("world_size", 9, "world_size"),
    ("rank", 2, "rank 2"),
    ("rank", -1, "rank -1"),
    ("max_bytes", 1000, "max_bytes 1000"),
    ("packet_max_bytes", 8, "packet_max_bytes 8"),
    ("timeout_ns", 0, "timeout_ns"),
])
def test_c_create_invalid_config(lib, field, value, needle):
    cfg = _config()
    setattr(cfg, field, value)
    comm = ctypes.c_void_p()
    code = lib.tpc_comm_create(ctypes.byref(cfg), ctypes.byref(comm))
    assert code == _lib.ERR_INVALID_ARG
    assert comm.value is None
    assert needle in lib.tpc_comm_last_error(None).decode()


def test_c_result_strings(lib):
    codes = [_lib.OK, _lib.ERR_INVALID_ARG, _lib.ERR_RUNTIME, _lib.ERR_PEER, _lib.ERR_STATE,
             _lib.ERR_TIMEOUT, _lib.ERR_MISMATCH, _lib.ERR_TOO_LARGE]
    assert codes == list(range(8))
    strings = [lib.tpc_result_string(c).decode() for c in codes]
    assert all(s.strip() for s in strings)
    assert len(set(strings)) == len(strings)
    assert "unknown" in lib.tpc_result_string(42).decode()


def test_c_null_communicator(lib):
    assert lib.tpc_comm_destroy(None) == _lib.OK
    assert lib.tpc_comm_ready(None) == _lib.ERR_INVALID_ARG
    assert lib.tpc_comm_buffer_bytes(None) == 0
    assert lib.tpc_comm_open_peer_count(None) == 0
    err = _lib.AsyncError()
    assert lib.tpc_comm_async_error(None, ctypes.byref(err)) == _lib.ERR_INVALID_ARG


def test_fastpath_is_bound_and_raises_the_ops_errors(lib):
    """tpcomm._fastpath, the eager all_reduce's C entry, is built beside the
    extension and bound to its C core: an id it does not know fails in that
    registry, with the message and the tag the torch ops' errors carry."""
    fast = _lib.fastpath()
    assert fast is not None
    with pytest.raises(RuntimeError, match=r"comm_id 987654321 is unknown .*\[tpc_result 8\]$") as info:
        fast.all_reduce(987654321, 0, 0, 64, 2, _lib.ALGO_PACKET, 0)
    err = _lib.translated(info.value)
    assert isinstance(err, tpcomm.CommunicatorClosed) and err.code == _lib.ERR_CLOSED
    assert "communicator not usable" not in str(err)  # the result string is ERR_CLOSED's own
    assert lib.tpc_result_string(_lib.ERR_CLOSED).decode() in str(err)
    with pytest.raises(TypeError, match="takes 7 arguments, got 2"):
        fast.all_reduce(1, 2)
    with pytest.raises(OverflowError):
        fast.all_reduce(-1, 0, 0, 64, 2, _lib.ALGO_PACKET, 0)
    with pytest.raises(TypeError):
        fast.all_reduce(1, "0", 0, 64, 2, _lib.ALGO_PACKET, 0)


def test_ctypes_structs_and_constants_match_the_header(tmp_path):
    """_lib's ctypes structs and every generated constant (_constants) against
    what a C compiler makes of csrc/tpcomm.h itself."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to read the header")
    fields = {"Config": ("tpc_config", _lib.Config), "AsyncError": ("tpc_async_error", _lib.AsyncError)}
    lines = []
    for _, (c_name, cls) in fields.items():
        lines.append(f'printf("{c_name} %zu\\n", sizeof({c_name}));')
        for name, _ in cls._fields_:
            lines.append(f'printf("{c_name}.{name} %zu\\n", offsetof({c_name}, {name}));')
    codes = [name for name in vars(_constants) if name.startswith("TPC_")]
    assert {"TPC_OK", "TPC_ALGO_PACKET", "TPC_FLOAT32", "TPC_MAX_RANKS"} <= set(codes)
    lines += [f'printf("{c} %lld\\n", (long long){c});' for c in codes]
    src = tmp_path / "layout.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "tpcomm.h"\nint main(void) {\n'
                   + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-std=c11", "-I", os.path.join(ROOT, "csrc"), str(src), "-o", str(exe)], check=True)
    seen = dict(line.rsplit(" ", 1) for line in subprocess.run([str(exe)], check=True, capture_output=True,
                                                                 text=True).stdout.splitlines())
    for _, (c_name, cls) in fields.items():
        assert int(seen[c_name]) == ctypes.sizeof(cls), c_name
        for name, _ in cls._fields_:
            assert int(seen[f"{c_name}.{name}"]) == getattr(cls, name).offset, (c_name, name)
    assert {c: int(seen[c]) for c in codes} == {c: getattr(_constants, c) for c in codes}


# ------------------------------------------------------------------ routing table

SHIPPED = routing_table.load_table()


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", ["*", "float32", "float16", "bfloat16"])
def test_policy_boundaries(op, world_size, dtype):
    rows = routing_table.bands_for(SHIPPED, op, world_size, dtype)
    assert rows == sorted(rows, key=lambda r: r[0])
    for i, (limit, backend) in enumerate(rows):
        assert routing.choose(rows, limit) == backend
        following = rows[i + 1][1] if i + 1 < len(rows) else "nccl"
        assert routing.choose(rows, limit + 1) == following
    assert routing.choose(rows, 0) == rows[0][1]
    assert routing.choose(rows, rows[-1][0] * 4) == "nccl"


def test_policy_shipped_table():
    """The shipped table (numbers come from benchmarks and change with them):
    both ops, a "*" row, increasing limits that are multiples of 16, packet
    bands before bulk bands, nothing past the benchmark's largest size
    (64 MiB) and no packet band past the default packet_max_bytes (1 MiB)."""
    assert os.path.exists(routing_table.DEFAULT_TABLE)
    assert "H200" in SHIPPED["about"]
    for op in routing.OPS:
        assert "*" in SHIPPED["routes"][op]
        for world, by_dtype in SHIPPED["routes"][op].items():
            for dtype, rows in by_dtype.items():
                limits = [limit for limit, _ in rows]
                backends = [backend for _, backend in rows]
                assert set(backends) <= set(routing.KERNELS), (op, world, dtype)
                assert backends == sorted(backends, key=lambda b: b != "packet"), (op, world, dtype)
                assert limits[-1] <= 64 * MiB and all(limit % 16 == 0 for limit in limits)
                # reduce_scatter's bands are its input per rank; the packet cap is on one chunk
                chunks = (int(world) if world != "*" else 2) if op == "reduce_scatter" else 1
                packet_cutover = max((limit for limit, b in rows if b in routing.PACKET_SLOT_KERNELS), default=0)
                assert packet_cutover // chunks <= 1 * MiB


def test_policy_lookup_falls_back_to_star():
    table = routing_table.load_table({"routes": {
        "all_reduce": {"3": {"*": [[100, "bulk"], [200, "packet"], [300, "bulk"]], "float16": [[50, "packet"]]},
                       "*": {"*": [[10, "bulk"]]}},
        "all_gather": {"*": {"*": [[32, "packet"], [64, "packet"], [128, "bulk"]]}}}})
    rows = routing_table.bands_for(table, "all_reduce", 3, "float32")
    assert [routing.choose(rows, n) for n in (100, 101, 201, 301)] == ["bulk", "packet", "bulk", "nccl"]
    assert routing_table.bands_for(table, "all_reduce", 3, "float16") == [(50, "packet")]
    assert routing_table.bands_for(table, "all_reduce", 2, "float16") == [(10, "bulk")]
    assert routing_table.bands_for(table, "all_reduce", 5) == [(10, "bulk")]
    assert routing_table.bands_for(table, "all_gather", 7) == [(32, "packet"), (64, "packet"), (128, "bulk")]


def test_policy_effective_routes_and_flatten():
    routes = routing_table.effective_routes(SHIPPED, 2, {"all_gather": "nccl"}, ("bulk",))
    assert set(routes) == set(routing.OPS)
    assert set(routes["all_reduce"]) == {"*", "float32", "float16", "bfloat16", "fused_norm"}
    assert routes["all_reduce"]["fused_norm"] == [(routing_table.FUSED_NORM_UNLIMITED, routing.FUSED_NORM_MODELLED)]
    assert routes["all_gather"]["*"] == [(1 << 62, "nccl")]
    assert all(b != "bulk" for bands in routes["all_reduce"].values() for _, b in bands)
    flat = routing_table.flatten(routes)
    assert flat["all_reduce/*/0"] == f"{routes['all_reduce']['*'][0][0]} packet"
    assert len(flat) == sum(len(b) for by_dtype in routes.values() for b in by_dtype.values())


@pytest.mark.parametrize("routes,needle", [
    ({"all_reduce": [[16, "packet"]]}, "routes for all_reduce must be an object"),
    ({"all_reduce": {"2": {"*": [[16, "packet"]]}}, "all_gather": {"*": {"*": [[16, "packet"]]}}},
     "all_reduce needs a '*' world-size row"),
    ({"all_reduce": {"9": {"*": [[16, "packet"]]}, "*": {"*": [[16, "packet"]]}}, "all_gather": {"*": {"*": [[16, "packet"]]}}},
     "all_reduce/9: world size must be"),
    ({"all_reduce": {"*": {"int8": [[16, "packet"]], "*": [[16, "packet"]]}}, "all_gather": {"*": {"*": [[16, "packet"]]}}},
     "all_reduce/*/int8: dtype must be"),
    ({"all_reduce": {"*": {"bfloat16": [[16, "packet"]]}}, "all_gather": {"*": {"*": [[16, "packet"]]}}},
     "needs a '*' dtype row"),
    ({"all_reduce": {"*": {"*": [[32, "packet"], [16, "bulk"]]}}, "all_gather": {"*": {"*": [[16, "packet"]]}}},
     "limits must increase"),
    ({"all_reduce": {"*": {"*": [[32, "fast"]]}}, "all_gather": {"*": {"*": [[16, "packet"]]}}},
     "backend 'fast' is not one of"),
    ({"all_reduce": {"*": {"*": [[True, "packet"]]}}, "all_gather": {"*": {"*": [[16, "packet"]]}}},
     "must be [limit bytes, backend]"),
    ({"all_reduce": {"*": {"*": []}}, "all_gather": {"*": {"*": [[16, "packet"]]}}}, "non-empty list"),
    ({"all_reduce": {"*": {"*": [[16, "line"]]}}, "all_gather": {"*": {"*": [[16, "line"]]}},
      "reduce_scatter": {"*": {"*": [[16, "packet"], [32, "two_shot"]]}}},
     "reduce_scatter/*/*: reduce_scatter has no two_shot kernel"),
    ({"all_reduce": {"*": {"*": [[16, "line"]]}}, "all_gather": {"*": {"*": [[16, "two_shot"]]}}},
     "all_gather/*/*: all_gather has no two_shot kernel"),
])
def test_policy_bad_tables_name_the_entry(routes, needle):
    with pytest.raises(routing_table.TableError, match=re.escape(needle)):
        routing_table.load_table({"routes": routes})


def test_policy_ops_a_table_lacks_come_from_the_shipped_one():
    table = routing_table.load_table({"routes": {"all_reduce": {"*": {"*": [[64, "bulk"]]}}}})
    assert table["routes"]["all_reduce"]["*"]["*"] == [(64, "bulk")]
    for op in ("all_gather", "reduce_scatter"):
        assert table["routes"][op] == SHIPPED["routes"][op]


def test_policy_table_files(tmp_path):
    good = tmp_path / "good.json"
    good.write_text('{"about": "test", "routes": {"all_reduce": {"*": {"*": [[64, "packet"]]}}, '
                    '"all_gather": {"*": {"*": [[64, "bulk"]]}}}}')
    assert routing_table.load_table(str(good))["about"] == "test"
    with pytest.raises(routing_table.TableError, match="cannot be read"):
        routing_table.load_table(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(routing_table.TableError, match="is not JSON"):
        routing_table.load_table(str(bad))


class _RecordingFastpath:
    """Stands in for tpcomm._fastpath: records each call, or raises."""

    def __init__(self, error=None):
        self.calls, self.error = [], error

    def all_reduce(self, *args):
        self.calls.append(args)
        if self.error:
            raise RuntimeError(self.error)


def _kernels_on_cpu(monkeypatch, fast):
    """tpcomm's Kernels for a made-up id, with the fast path and the _out op
    replaced by recorders and the current stream read as 1234: which path an
    eager all_reduce takes, and with what, can be seen without a GPU."""
    from tpcomm.backends.kernels import Kernels

    kernels = Kernels(77, 0, routing.Caps(4, 1 << 20, 1 << 16, _constants.TPC_PLATFORM_CUDA))  # 4 ranks: "bulk" is TPC_ALGO_BULK
    kernels._fastpath = fast
    through_op = []
    kernels._all_reduce_out = lambda x, out, handle, algo: through_op.append((x, out, handle, algo))
    monkeypatch.setattr(kernels_module, "_raw_stream", lambda device: 1234 + device)
    return kernels, through_op


@pytest.mark.parametrize("dtype, code", [(torch.float32, 0), (torch.float16, 1), (torch.bfloat16, 2)])
def test_eager_all_reduce_takes_the_fast_path_when_aligned(lib, monkeypatch, dtype, code):
    fast = _RecordingFastpath()
    kernels, through_op = _kernels_on_cpu(monkeypatch, fast)
    x = torch.ones(64, dtype=dtype)
    y = kernels.all_reduce(x, "line")
    assert through_op == [] and y.shape == x.shape and y.dtype == dtype and y.data_ptr() != x.data_ptr()
    assert fast.calls == [(77, x.data_ptr(), y.data_ptr(), x.nbytes, code, _lib.ALGO_LINE, 1234)]
    out = torch.empty_like(x)  # out= and in place: the same call with that output
    assert kernels.all_reduce(x, "packet", out) is out and kernels.all_reduce(x, "bulk", x) is x
    assert fast.calls[1:] == [(77, x.data_ptr(), out.data_ptr(), x.nbytes, code, _lib.ALGO_PACKET, 1234),
                              (77, x.data_ptr(), x.data_ptr(), x.nbytes, code, _lib.ALGO_BULK, 1234)]


def test_eager_all_reduce_takes_the_op_otherwise(lib, monkeypatch):
    """Misaligned input or output, torch.compile tracing, or no fast path
    built: the _out torch op, which copies misaligned views."""
    fast = _RecordingFastpath()
    kernels, through_op = _kernels_on_cpu(monkeypatch, fast)
    base = torch.zeros(72, dtype=torch.bfloat16)
    view = base[2:66]  # 4 bytes past an aligned start
    assert view.data_ptr() % 16 == 4
    y = kernels.all_reduce(view, "packet")
    out_view = torch.empty(72, dtype=torch.bfloat16)[2:66]
    aligned = torch.ones(64, dtype=torch.bfloat16)
    kernels.all_reduce(aligned, "packet", out_view)
    monkeypatch.setattr(kernels_module, "_is_compiling", lambda: True)
    kernels.all_reduce(aligned, "line")
    monkeypatch.undo()
    kernels, through_op_unbuilt = _kernels_on_cpu(monkeypatch, None)
    kernels.all_reduce(aligned, "bulk")
    assert fast.calls == []
    assert [(t[0].data_ptr(), t[3]) for t in through_op] == [
        (view.data_ptr(), _lib.ALGO_PACKET), (aligned.data_ptr(), _lib.ALGO_PACKET),
        (aligned.data_ptr(), _lib.ALGO_LINE)]
    assert through_op[0][1] is y and through_op[1][1] is out_view
    assert [(t[0] is aligned, t[3]) for t in through_op_unbuilt] == [(True, _lib.ALGO_BULK)]


def test_eager_all_reduce_fast_path_errors_are_tpcomm_errors(lib, monkeypatch):
    fast = _RecordingFastpath("tpcomm: a peer did not arrive in time: peer 1 did not arrive [tpc_result 5]")
    kernels, _ = _kernels_on_cpu(monkeypatch, fast)
    with pytest.raises(tpcomm.CollectiveTimeout, match="peer 1 did not arrive") as info:
        kernels.all_reduce(torch.ones(64), "packet")
    assert info.value.code == _lib.ERR_TIMEOUT


def _body_communicator_fast_path(rank, world_size):
    """Communicator.all_reduce runs the memoised route's callable, the one
    Kernels.all_reduce runs: a CPU communicator given a made-up id, caps and
    recording Kernels shows the fast path's call, its stats, and where the
    other cases go."""
    from tpcomm.backends.kernels import Kernels

    comm = tpcomm.Communicator(device="cpu")
    fast = _RecordingFastpath()
    caps = routing.Caps(world_size, comm.max_bytes, comm.packet_max_bytes, comm.platform)
    kernels = Kernels(77, 0, caps)
    kernels._fastpath = fast
    through_op = []
    kernels._all_reduce_out = lambda x, out, handle, algo: through_op.append((x, out, algo))
    kernels_module._raw_stream = lambda device: 1234
    comm.comm_id, comm._kernels = 77, kernels
    comm._caps = caps
    x = torch.ones(64, dtype=torch.bfloat16)
    route = comm.route_all_reduce(x)
    assert route in routing.KERNELS, route
    y = comm.all_reduce(x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.data_ptr() != x.data_ptr()
    assert fast.calls == [(77, x.data_ptr(), y.data_ptr(), x.nbytes, 2, routing.algo_code("all_reduce", route, caps), 1234)]
    comm.all_reduce(x)  # the memoised route: the same call again
    assert fast.calls[1][0::3] == (77, x.nbytes, 1234) and comm.stats() == {
        ("all_reduce", route): {"calls": 2, "bytes": 2 * x.nbytes}}
    assert comm._all_reduce_memo[(x.dtype, x.nbytes)][1] is kernels.all_reduce_runner(x.dtype, route)
    out = torch.empty_like(x)  # out= takes the fast path too
    assert comm.all_reduce(x, out) is out and fast.calls[2][2] == out.data_ptr()
    view = torch.ones(72, dtype=torch.bfloat16)[2:66]  # misaligned: the op path
    z = comm.all_reduce(view)
    assert len(fast.calls) == 3 and through_op[0][0].data_ptr() == view.data_ptr() and through_op[0][1] is z
    is_compiling = kernels_module._is_compiling
    kernels_module._is_compiling = lambda: True  # tracing: the op path
    comm.all_reduce(x)
    assert len(fast.calls) == 3 and through_op[1][0] is x
    kernels_module._is_compiling = is_compiling
    fast.error = "tpcomm: op failed: peer 1 did not arrive [tpc_result 5]"
    try:
        comm.all_reduce(x)
        raise AssertionError("the fast path's error was not raised")
    except tpcomm.CollectiveTimeout as e:
        assert e.code == _lib.ERR_TIMEOUT and "peer 1 did not arrive" in str(e)
    wide = torch.full((8,), float(rank + 1), dtype=torch.float64)  # not reducible by the kernels: NCCL (gloo)
    assert comm.all_reduce(wide).tolist() == [3.0] * 8 and len(fast.calls) == 4
    comm.comm_id, comm._kernels, comm._caps = 0, None, None
    comm.close()
    try:
        comm.all_reduce(x)
        raise AssertionError("a closed communicator took an op")
    except tpcomm.CommunicatorClosed:
        pass


def test_communicator_all_reduce_runs_the_fast_path(lib):
    from multiproc import run_ranks

    run_ranks(2, _body_communicator_fast_path)
