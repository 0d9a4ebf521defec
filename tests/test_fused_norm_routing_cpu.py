"""The routing table's cap on the fused norm kernel family, without a GPU:
"fused_norm_max_bytes" checked as the table's other sizes are, the cost
model's default per world size, the routes past the cap (all_reduce_add_rms_norm
"split" where it can, every other pattern and every FP8 epilogue "unfused"),
the cap among the effective routes the ranks compare, and the label saying
whether it is the cost model's or the table's."""
import re

import pytest
import torch

import tpcomm
from tpcomm import Config, norm_fp8, norm_patterns, routing, routing_table
from tpcomm import _constants as C
from tpcomm.norm_patterns import Pattern
from routing_only import FALLBACK, meta

KiB, MiB = 1024, 1024 * 1024
ROUTES = {op: {"*": {"*": [[64 * KiB, "packet"], [16 * MiB, "bulk"]]}} for op in routing.OPS}
ROW = 4096 * 2  # bytes of one bf16 row of hidden 4096


def _table(**fields):
    return {"routes": ROUTES, **fields}


def _comm(world_size, table=None, packet_max_bytes=4 * MiB, platform=C.TPC_PLATFORM_CUDA):
    comm = object.__new__(tpcomm.Communicator)
    comm.config, comm.world_size = Config(), world_size
    comm._routes = routing_table.effective_routes(routing_table.load_table(table or _table()), world_size)
    comm._caps = routing.Caps(world_size, 16 * MiB, packet_max_bytes, platform)
    comm._nccl, comm._fallback = FALLBACK, FALLBACK.backend
    return comm


@pytest.mark.parametrize("value,needle", [
    ([1], "fused_norm_max_bytes must be an object of world size: bytes"),
    ({"9": 1}, "fused_norm_max_bytes/9: world size must be '*' or 2..8"),
    ({"one": 1}, "fused_norm_max_bytes/one: world size must be"),
    ({"4": 0}, "fused_norm_max_bytes/4 must be a positive integer, got 0"),
    ({"4": -16}, "fused_norm_max_bytes/4 must be a positive integer"),
    ({"*": True}, "fused_norm_max_bytes/* must be a positive integer, got True"),
    ({"8": 1.5}, "fused_norm_max_bytes/8 must be a positive integer, got 1.5"),
    ({"8": "1048576"}, "fused_norm_max_bytes/8 must be a positive integer"),
])
def test_bad_caps_are_refused_naming_the_entry(value, needle):
    with pytest.raises(routing_table.TableError, match=re.escape(needle)):
        routing_table.load_table(_table(fused_norm_max_bytes=value))


def test_the_checker_is_the_one_of_quantized_min_bytes():
    with pytest.raises(routing_table.TableError, match="quantized_min_bytes/3 must be a positive integer"):
        routing_table.load_table(_table(quantized_min_bytes={"3": 0}))
    loaded = routing_table.load_table(_table(fused_norm_max_bytes={"4": 1 * MiB, "*": 256 * KiB}))
    assert loaded["fused_norm_max_bytes"] == {"4": 1 * MiB, "*": 256 * KiB}
    assert routing_table.load_table(_table())["fused_norm_max_bytes"] == {}


def test_cost_model_default_per_world_size():
    unlimited = routing_table.FUSED_NORM_UNLIMITED
    assert unlimited >= tpcomm._constants.TPC_MAX_BYTES_LIMIT  # no input is larger
    # 1.5 MiB * n / ((n - 1) (n - 3)) from 4 ranks on
    assert [routing_table.fused_norm_default(n) for n in range(2, 9)] == [
        unlimited, unlimited, 2 * MiB, 983040, 629145, 458752, 359511]
    assert routing_table.FUSED_NORM_FIXED_BYTES == 3 * MiB // 2


def test_the_tables_entry_for_the_world_size_then_star_then_the_model():
    table = routing_table.load_table(_table(fused_norm_max_bytes={"4": 1 * MiB, "*": 256 * KiB}))
    assert routing_table.fused_norm_max_bytes(table, 4) == (1 * MiB, True)
    assert routing_table.fused_norm_max_bytes(table, 8) == (256 * KiB, True)
    assert routing_table.fused_norm_max_bytes(routing_table.load_table(_table()), 8) == (359511, False)
    assert routing_table.fused_norm_max_bytes(routing_table.load_table(_table()), 2) == \
        (routing_table.FUSED_NORM_UNLIMITED, False)


def _routes_of(comm, rows, hidden=4096, dtype=torch.bfloat16):
    """(ADD_NORM, NORM_ADD, NORM_ADD_NORM, ADD_NORM with 1 + w, ADD_NORM per_token FP8) routes of rows x hidden."""
    x, w = meta((rows, hidden), dtype), meta((hidden,), dtype)
    return (comm.route_all_reduce_add_rms_norm(x, w),
            norm_patterns.route(comm, Pattern.NORM_ADD, x, w, None, 0.0),
            norm_patterns.route(comm, Pattern.NORM_ADD_NORM, x, w, w, 0.0),
            norm_patterns.route(comm, Pattern.ADD_NORM, x, w, None, 1.0),
            norm_fp8.route(comm, Pattern.ADD_NORM, x, w, None, 0.0))


def test_past_the_default_cap_add_norm_splits_and_the_rest_run_unfused():
    comm = _comm(8)  # cap 359511 B; packet cap 4 MiB
    assert _routes_of(comm, 40) == ("fused",) * 5                       # 320 KiB
    assert _routes_of(comm, 48) == ("split",) + ("unfused",) * 4        # 384 KiB, 6 rows a rank
    assert _routes_of(comm, 44) == ("unfused",) * 5                     # 44 rows do not divide among 8
    assert _routes_of(_comm(4), 256) == ("fused",) * 5                  # 2 MiB: the cap itself
    assert _routes_of(_comm(4), 264) == ("split",) + ("unfused",) * 4
    # up to 3 ranks the packet cap alone bounds the kernel
    for world in (2, 3):
        assert _routes_of(_comm(world), 510) == ("fused",) * 5           # 3.98 MiB
        assert _routes_of(_comm(world), 516)[0] == "split"               # past the 4 MiB packet cap


def test_the_tables_cap_routes_and_a_rocm_build_keeps_fp8_unfused():
    table = _table(fused_norm_max_bytes={"2": 64 * KiB})
    assert _routes_of(_comm(2, table), 8) == ("fused",) * 5              # 64 KiB
    assert _routes_of(_comm(2, table), 10) == ("split",) + ("unfused",) * 4
    assert _routes_of(_comm(2, table, platform=C.TPC_PLATFORM_ROCM), 8) == ("fused",) * 4 + ("unfused",)


def test_effective_routes_and_flatten_carry_the_cap():
    modelled = routing_table.effective_routes(routing_table.load_table(_table()), 8)
    assert modelled["all_reduce"]["fused_norm"] == [(359511, routing.FUSED_NORM_MODELLED)]
    assert routing.fused_norm_max(modelled) == 359511
    measured = routing_table.effective_routes(routing_table.load_table(_table(fused_norm_max_bytes={"8": MiB})), 8)
    assert routing_table.flatten(measured)["all_reduce/fused_norm/0"] == f"{MiB} fused"
    # ranks whose tables cap the kernel differently disagree on exactly that key
    a, b = routing_table.flatten(modelled), routing_table.flatten(measured)
    assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {"all_reduce/fused_norm/0"}
    # forced or forbidden backends leave it alone; routes without the row have no cap
    forced = routing_table.effective_routes(routing_table.load_table(_table()), 8, {"all_reduce": "nccl"}, ("bulk",))
    assert forced["all_reduce"]["fused_norm"] == modelled["all_reduce"]["fused_norm"]
    assert routing.fused_norm_max({"all_reduce": {"*": []}}) == float("inf")


def test_summary_labels_the_cap_as_a_cost_model_default_or_the_tables():
    caps = routing.Caps(8, 16 * MiB, 1 * MiB, C.TPC_PLATFORM_CUDA)
    modelled = routing_table.effective_routes(routing_table.load_table(_table()), 8)
    assert f"fused norm kernels up to 359511 B per rank within the packet cap (cost-model default)" in \
        routing.summary(modelled, caps)
    measured = routing_table.effective_routes(routing_table.load_table(_table(fused_norm_max_bytes={"*": MiB})), 8)
    text = routing.summary(measured, caps)
    assert f"fused norm kernels up to {MiB} B per rank within the packet cap (table)" in text
    assert "cost-model" not in text
