"""The quantized all-reduce's opt-in, agreement and routing without a GPU:
Config.quantize / TPCOMM_QUANTIZE, the routing table's quantized_min_bytes,
route_all_reduce's "quantized_<mode>" (float16/bfloat16 from the minimum
size on, nothing when quantize is off), the fused norm's routes untouched,
and ranks that disagree on the mode raising at init (2-process gloo runs)."""
import json
import types

import pytest
import torch

import tpcomm
from tpcomm import Config, _constants as C, routing_table, routing
from tpcomm.routing import ALGO_CODES as ALGOS
from multiproc import run_ranks
from routing_only import FALLBACK

KiB, MiB = 1024, 1024 * 1024
TABLE = {"routes": {op: {"*": {"*": [[64 * KiB, "packet"], [16 * MiB, "bulk"]]}}
                    for op in ("all_reduce", "all_gather", "reduce_scatter")}}


def _comm(quantize=None, world_size=4, table=TABLE, force=None, platform=C.TPC_PLATFORM_CUDA, max_bytes=16 * MiB):
    comm = object.__new__(tpcomm.Communicator)
    comm.config, comm.world_size = Config(quantize=quantize), world_size
    comm._routes = routing_table.effective_routes(routing_table.load_table(table), world_size, force, (), quantize)
    comm._caps = routing.Caps(world_size, max_bytes, 1 * MiB, platform)
    comm._nccl, comm._fallback = FALLBACK, FALLBACK.backend
    return comm


def _t(nbytes, dtype=torch.bfloat16):
    return torch.empty(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device="meta")


def test_config_quantize_from_argument_and_env(monkeypatch):
    assert Config().quantize is None and Config().describe()["quantize"] == "None"
    for mode in ("fp8", "int8", "int4"):
        assert Config(quantize=mode).checked().describe()["quantize"] == mode
        monkeypatch.setenv("TPCOMM_QUANTIZE", mode.upper())
        assert Config.from_env().quantize == mode
    monkeypatch.setenv("TPCOMM_QUANTIZE", "int2")
    with pytest.raises(ValueError, match=r"quantize='int2' must be None or one of .*TPCOMM_\* variables"):
        Config.from_env()
    with pytest.raises(ValueError, match="quantize='bf16'"):
        Config(quantize="bf16").checked()


def test_algo_codes_are_the_headers():
    assert ALGOS["quantized_fp8"] == C.TPC_ALGO_QUANTIZED_FP8
    assert ALGOS["quantized_int8"] == C.TPC_ALGO_QUANTIZED_INT8
    assert ALGOS["quantized_int4"] == C.TPC_ALGO_QUANTIZED_INT4
    assert len(set(ALGOS.values())) == len(ALGOS)
    assert C.TPC_QUANT_GROUP == 32


@pytest.mark.parametrize("mode", routing.QUANTIZE_MODES)
def test_quantized_from_the_minimum_size_on(mode):
    c = _comm(mode)
    minimum = routing_table.QUANTIZED_MIN_BYTES
    for dtype in (torch.bfloat16, torch.float16):
        assert c.route_all_reduce(_t(minimum - 16, dtype)) == "bulk"
        assert c.route_all_reduce(_t(minimum, dtype)) == f"quantized_{mode}"
        assert c.route_all_reduce(_t(16 * MiB, dtype)) == f"quantized_{mode}"
        assert c.route_all_reduce(_t(16 * MiB + 16, dtype)) == "nccl"  # over max_bytes
        assert c.route_all_reduce(_t(16 * KiB, dtype)) == "packet"
    # fp32 keeps the exact kernels
    assert c.route_all_reduce(_t(4 * MiB, torch.float32)) == "bulk"
    # only all_reduce: the other ops keep their routes
    assert routing.route(c._routes, c._caps, "reduce_scatter", torch.bfloat16, 4 * MiB) == "bulk"
    assert routing.route(c._routes, c._caps, "all_gather", torch.bfloat16, 4 * MiB, 4 * MiB) == "bulk"


def test_nothing_is_quantized_unless_turned_on():
    c = _comm(None)
    assert "quantized" not in c._routes["all_reduce"]
    for size in (16, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert not c.route_all_reduce(_t(size, dtype)).startswith("quantized")


def test_forced_all_reduce_and_builds_without_the_kernel_are_not_quantized():
    assert _comm("int8", force={"all_reduce": "bulk"}).route_all_reduce(_t(4 * MiB)) == "bulk"
    assert _comm("int8", platform=C.TPC_PLATFORM_ROCM).route_all_reduce(_t(4 * MiB)) == "bulk"
    assert "CUDA only" in routing.quantized_refusal(routing.Caps(2, 16 * MiB, MiB, C.TPC_PLATFORM_ROCM), torch.bfloat16, 4 * MiB)
    assert "float32" in routing.quantized_refusal(routing.Caps(2, 16 * MiB, MiB, C.TPC_PLATFORM_CUDA), torch.float32, 4 * MiB)
    assert routing.quantized_refusal(None, torch.bfloat16, 4 * MiB) == "the custom path is off"


def test_fused_norm_keeps_its_routes():
    plain, quantized = _comm(None), _comm("int4")
    for rows in (1, 64, 4096):
        x = torch.empty(rows, 4096, dtype=torch.bfloat16, device="meta")
        w = torch.empty(4096, dtype=torch.bfloat16, device="meta")
        assert quantized.route_all_reduce_add_rms_norm(x, w) == plain.route_all_reduce_add_rms_norm(x, w)


def test_table_minimum_per_world_size():
    table = dict(TABLE, quantized_min_bytes={"2": 8 * MiB, "*": 256 * KiB})
    assert _comm("fp8", world_size=2, table=table).route_all_reduce(_t(4 * MiB)) == "bulk"
    assert _comm("fp8", world_size=2, table=table).route_all_reduce(_t(8 * MiB)) == "quantized_fp8"
    assert _comm("fp8", world_size=8, table=table).route_all_reduce(_t(256 * KiB)) == "quantized_fp8"
    assert _comm("fp8", world_size=8, table=table).route_all_reduce(_t(256 * KiB - 16)) == "bulk"
    loaded = routing_table.load_table(table)
    assert routing_table.quantized_min_bytes(loaded, 2) == 8 * MiB and routing_table.quantized_min_bytes(loaded, 3) == 256 * KiB
    assert routing_table.quantized_min_bytes(routing_table.load_table(TABLE), 4) == routing_table.QUANTIZED_MIN_BYTES
    # the shipped table's value, whatever it is, is one the loader accepts
    shipped = routing_table.load_table()
    assert all(routing_table.quantized_min_bytes(shipped, w) > 0 for w in range(2, 9))


@pytest.mark.parametrize("bad, needle", [({"9": 1}, "world size"), ({"*": 0}, "positive integer"),
                                         ({"*": True}, "positive integer"), ([1], "must be an object")])
def test_bad_minimums_are_refused(bad, needle):
    with pytest.raises(routing_table.TableError, match=needle):
        routing_table.load_table(dict(TABLE, quantized_min_bytes=bad))


def test_the_routes_the_ranks_compare_carry_the_mode():
    flat = routing_table.flatten(_comm("int8")._routes)
    assert flat["all_reduce/quantized/0"] == f"{routing_table.QUANTIZED_MIN_BYTES} quantized_int8"
    assert "all_reduce/quantized/0" not in routing_table.flatten(_comm(None)._routes)


def _body_disagreeing_modes(rank, world_size):
    config = Config(quantize="int8") if rank == 1 else Config()
    with pytest.raises(ValueError, match=r"all_reduce/quantized/0"):
        tpcomm.Communicator(device="cpu", config=config)
    with pytest.raises(ValueError, match=r"quantize: rank 0: fp8, rank 1: int4"):
        tpcomm.Communicator(device="cpu", config=Config(quantize="fp8" if rank == 0 else "int4"))
    comm = tpcomm.Communicator(device="cpu", config=Config(quantize="int8"))  # agreeing ranks
    assert torch.equal(comm.all_reduce(torch.ones(2)), torch.full((2,), float(world_size)))
    comm.close()


def test_ranks_that_disagree_on_the_mode_raise():
    run_ranks(2, _body_disagreeing_modes)


def test_table_file_round_trip(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(dict(TABLE, quantized_min_bytes={"4": 2 * MiB})))
    assert routing_table.quantized_min_bytes(routing_table.load_table(str(path)), 4) == 2 * MiB


def test_summary_names_the_quantized_route():
    caps = routing.Caps(4, 16 * MiB, 1 * MiB, C.TPC_PLATFORM_CUDA)
    text = routing.summary(_comm("int4")._routes, caps)
    assert f"all_reduce of float16 and bfloat16 from {routing_table.QUANTIZED_MIN_BYTES} B: quantized_int4 (not exact)" in text
    assert "quantized" not in routing.summary(_comm(None)._routes, caps)


def test_the_decline_contract_takes_the_quantized_route():
    """should_custom_ar (vLLM's contract) says yes where the quantized kernel
    takes the call, as for the exact kernels."""
    for mode, want in (("int8", True), (None, True)):
        comm = _comm(mode)
        comm._closed = False
        comm._check_input = lambda x, what: None  # a tensor on the communicator's device
        # the dispatcher's memo, which should_custom_ar reads, with kernels that are never run here
        comm._memo, comm._stat_cells, comm._aiter, comm._agreement = {op: {} for op in routing.OPS}, {}, None, None
        comm._kernels = types.SimpleNamespace(all_reduce_runner=lambda dtype, algo: None)
        x = _t(4 * MiB)
        assert comm.route_all_reduce(x) == (f"quantized_{mode}" if mode else "bulk")
        assert comm.should_custom_ar(x) is want
        assert comm.should_custom_ar(_t(64 * MiB)) is False  # over max_bytes: NCCL's
