"""tpcomm.Communicator on CPU tensors: every call falls back to torch.distributed
(gloo here), so its results, argument checks and life cycle are tested with
real multi-process groups on a machine without a GPU (tests/multiproc.py runs
the ranks)."""
import os
import time

import pytest
import torch
import torch.distributed as dist

import tpcomm
from bitexact import assert_bits_equal, exact_values, expected_sum
from multiproc import run_ranks
from tpcomm import policy

KiB = 1024
MiB = 1024 * KiB


# -------------------------------------------------------------- rank bodies

def _check_all_reduce(comm, rank, world_size):
    dtypes = [torch.float32, torch.int64, torch.float16, torch.bfloat16, torch.float64, torch.int32]
    for seed, dtype in enumerate(dtypes):
        for shape in [(4,), (5, 8), (3, 4, 16)]:
            x = exact_values(rank, shape, dtype, seed)
            x_before = x.clone()
            y = comm.all_reduce(x)
            assert_bits_equal(y, expected_sum(world_size, shape, dtype, seed), f"all_reduce {dtype} {shape}")
            assert_bits_equal(x, x_before, "out-of-place all_reduce changed its input")
            assert y.data_ptr() != x.data_ptr()

    # out=x: in place, returns x itself
    x = exact_values(rank, (6, 16), torch.float32, seed=11)
    y = comm.all_reduce(x, out=x)
    assert y is x
    assert_bits_equal(x, expected_sum(world_size, (6, 16), torch.float32, seed=11), "all_reduce out=x")

    # out=another tensor: written and returned, input untouched
    x = exact_values(rank, (6, 16), torch.int64, seed=12)
    x_before = x.clone()
    out = torch.full_like(x, 7)
    y = comm.all_reduce(x, out=out)
    assert y is out
    assert_bits_equal(out, expected_sum(world_size, (6, 16), torch.int64, seed=12), "all_reduce out=")
    assert_bits_equal(x, x_before, "all_reduce out= changed its input")

    # non-contiguous inputs: a transposed view and a strided slice
    base = exact_values(rank, (8, 6), torch.float32, seed=13)
    base_before = base.clone()
    y = comm.all_reduce(base.t())
    assert_bits_equal(y, expected_sum(world_size, (8, 6), torch.float32, seed=13).t(), "transposed all_reduce")
    assert_bits_equal(base, base_before, "transposed all_reduce changed its input")
    y = comm.all_reduce(base[:, ::2])
    assert_bits_equal(y, expected_sum(world_size, (8, 6), torch.float32, seed=13)[:, ::2], "strided all_reduce")

    # routing: everything goes to torch.distributed on CPU, whatever the size
    for n in (4, 64, 256 * KiB // 4, MiB // 4):
        assert comm.route_all_reduce(torch.empty(n)) == "nccl"


def _check_all_gather(comm, rank, world_size):
    cases = [((7,), [0, -1]), ((3, 4), [0, 1, -1, -2]), ((2, 3, 5), [0, 1, 2, -1])]
    for seed, dtype in enumerate([torch.float32, torch.int64, torch.float16, torch.uint8]):
        for shape, dims in cases:
            x = exact_values(rank, shape, dtype, seed)
            x_before = x.clone()
            parts = [exact_values(r, shape, dtype, seed) for r in range(world_size)]
            for dim in dims:
                y = comm.all_gather(x, dim=dim)
                assert_bits_equal(y, torch.cat(parts, dim), f"all_gather {dtype} {shape} dim={dim}")
                assert y.is_contiguous()
                assert comm.route_all_gather(x, dim) == "nccl"
            assert_bits_equal(x, x_before, "all_gather changed its input")
    # default dim is 0
    x = exact_values(rank, (2, 3), torch.float32, seed=20)
    parts = [exact_values(r, (2, 3), torch.float32, seed=20) for r in range(world_size)]
    assert_bits_equal(comm.all_gather(x), torch.cat(parts, 0), "all_gather default dim")
    # a non-contiguous input
    base = exact_values(rank, (4, 6), torch.float32, seed=21)
    parts = [exact_values(r, (4, 6), torch.float32, seed=21).t() for r in range(world_size)]
    for dim in (0, 1, -1):
        assert_bits_equal(comm.all_gather(base.t(), dim=dim), torch.cat(parts, dim), f"transposed all_gather dim={dim}")


def _check_reduce_scatter(comm, rank, world_size):
    """Rank r gets the sum of every rank's part r along dim, in any dtype
    gloo sums; bad dims and sizes raise before any communication."""
    n = world_size
    for seed, dtype in enumerate([torch.float32, torch.float16, torch.bfloat16, torch.int64]):
        for shape, dims in [((2 * n,), [0, -1]), ((n, 5), [0]), ((3, 4 * n), [1, -1]), ((2, n, 3), [1])]:
            x = exact_values(rank, shape, dtype, seed)
            x_before = x.clone()
            total = expected_sum(world_size, shape, dtype, seed)
            for dim in dims:
                y = comm.reduce_scatter(x, dim=dim)
                assert_bits_equal(y, total.chunk(n, dim)[rank].contiguous(), f"reduce_scatter {dtype} {shape} dim={dim}")
                assert y.is_contiguous()
                assert comm.route_reduce_scatter(x) == "nccl"
            assert_bits_equal(x, x_before, "reduce_scatter changed its input")
    base = exact_values(rank, (4 * n, 3), torch.float32, seed=9)
    y = comm.reduce_scatter(base.t(), dim=1)  # a non-contiguous input
    assert_bits_equal(y, expected_sum(world_size, (4 * n, 3), torch.float32, seed=9).t().chunk(n, 1)[rank].contiguous(),
                      "reduce_scatter of a transposed input")
    with pytest.raises(ValueError, match="divisible by the world size"):
        comm.reduce_scatter(torch.ones(n + 1))
    with pytest.raises(ValueError, match="at least one dimension"):
        comm.reduce_scatter(torch.tensor(1.0))
    with pytest.raises(IndexError, match="out of range"):
        comm.reduce_scatter(torch.ones(n), dim=1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        comm.reduce_scatter([1.0] * n)


def _check_errors(comm, rank, world_size):
    x = torch.ones(4, 4)
    with pytest.raises(TypeError, match="torch.Tensor"):
        comm.all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match="torch.Tensor"):
        comm.all_reduce(x, out="nope")
    with pytest.raises(TypeError, match="torch.Tensor"):
        comm.all_gather(3.0)
    with pytest.raises(ValueError, match="shape and dtype"):
        comm.all_reduce(x, out=torch.empty(16))
    with pytest.raises(ValueError, match="shape and dtype"):
        comm.all_reduce(x, out=torch.empty(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape and dtype"):
        comm.all_reduce(x, out=torch.empty(4, 8)[:, ::2])  # not contiguous
    with pytest.raises(ValueError, match="meta"):
        comm.all_reduce(torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="at least one dimension"):
        comm.all_gather(torch.tensor(1.0))
    for dim in (2, -3, 100):
        with pytest.raises(IndexError, match="out of range"):
            comm.all_gather(x, dim=dim)
    # constructor arguments are checked before any collective
    for kwargs in ({"max_bytes": 10}, {"max_bytes": 0}, {"packet_max_bytes": 24}, {"timeout_s": 0}):
        with pytest.raises(ValueError):
            tpcomm.Communicator(device="cpu", **kwargs)
    # the communicator still works after all of those
    y = comm.all_reduce(torch.full((4,), float(rank)))
    assert_bits_equal(y, torch.full((4,), float(sum(range(world_size)))), "all_reduce after errors")


def _check_disabled(comm, reason_needle):
    assert comm.enabled is False
    assert comm.handle == 0
    assert reason_needle in comm.disabled_reason, comm.disabled_reason
    assert "NCCL only" in repr(comm)
    comm.check()  # nothing to check without the custom path
    # every rank holds the same verdict
    reasons = [None] * comm.world_size
    dist.all_gather_object(reasons, comm.disabled_reason, group=comm.group)
    assert len(set(reasons)) == 1, reasons


def _check_close(comm, rank, world_size):
    with comm.capture() as c:
        assert c is comm
        y = comm.all_reduce(torch.ones(4))
    assert_bits_equal(y, torch.full((4,), float(world_size)), "all_reduce in capture()")
    comm.close()
    comm.close()  # twice is fine
    assert "closed" in repr(comm)
    with pytest.raises(RuntimeError, match="closed"):
        comm.all_reduce(torch.ones(4))
    with pytest.raises(RuntimeError, match="closed"):
        comm.all_gather(torch.ones(4))
    with pytest.raises(RuntimeError, match="closed"):
        with comm.capture():
            pass


def _body_main(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    assert comm.rank == rank and comm.world_size == world_size
    assert comm.device == torch.device("cpu")
    _check_disabled(comm, "cpu")
    assert comm.disabled_reason.startswith("rank 0: ")
    _check_all_reduce(comm, rank, world_size)
    _check_all_gather(comm, rank, world_size)
    _check_reduce_scatter(comm, rank, world_size)
    _check_errors(comm, rank, world_size)
    # a second communicator on the same group works alongside the first
    other = tpcomm.Communicator(device=torch.device("cpu"))
    x = exact_values(rank, (16,), torch.float32, seed=30)
    assert_bits_equal(other.all_reduce(x), expected_sum(world_size, (16,), torch.float32, seed=30), "second communicator")
    other.close()
    _check_close(comm, rank, world_size)


def _body_subgroup(rank, world_size):
    """A Communicator over a subgroup reduces over that subgroup only."""
    members = [0, world_size - 1]
    group = dist.new_group(members)  # collective: every rank calls it
    if rank in members:
        comm = tpcomm.Communicator(group, device="cpu")
        assert comm.world_size == 2
        assert comm.rank == members.index(rank)
        assert comm.enabled is False
        x = exact_values(rank, (3, 16), torch.float32, seed=40)
        y = comm.all_reduce(x)
        assert_bits_equal(y, expected_sum(world_size, (3, 16), torch.float32, seed=40, ranks=members), "subgroup all_reduce")
        g = comm.all_gather(x, dim=1)
        assert_bits_equal(g, torch.cat([exact_values(r, (3, 16), torch.float32, seed=40) for r in members], 1),
                          "subgroup all_gather")
        comm.close()


def _body_disabled_by_env(rank, world_size):
    assert os.environ.get("TPCOMM_DISABLE") == "1"
    comm = tpcomm.Communicator(device="cpu")
    _check_disabled(comm, "TPCOMM_DISABLE")
    assert comm.disabled_reason == "rank 0: disabled by TPCOMM_DISABLE (or Config.disable)"
    y = comm.all_reduce(torch.full((8,), float(rank + 1)))
    assert_bits_equal(y, torch.full((8,), float(world_size * (world_size + 1) // 2)), "all_reduce when disabled")
    comm.close()


def _body_serials_per_group(rank, world_size):
    """Creation numbers are counted per group: rank 0 belongs to {0,1} and
    {0,2} and creates their communicators in the opposite order from the
    order in which the groups were made; each group's ranks still agree. A
    rank whose count on a group really is off is told so."""
    from tpcomm import communicator

    g01 = dist.new_group([0, 1])
    g02 = dist.new_group([0, 2])
    made = {}
    for name, group in {0: [("g02", g02), ("g01", g01)], 1: [("g01", g01)], 2: [("g02", g02)]}[rank]:
        made[name] = tpcomm.Communicator(group, device="cpu")
    for name, comm in made.items():
        assert comm.serial == 0, (name, comm.serial)
        assert "different orders" not in comm.disabled_reason, comm.disabled_reason
    # a second communicator on {0,1}: number 1 on both of its ranks
    if rank in (0, 1):
        again = tpcomm.Communicator(g01, device="cpu")
        assert again.serial == 1 and "different orders" not in again.disabled_reason
        again.close()
        # rank 1 skips a number on this group (as if it had created one the
        # other rank did not): the next communicator says so on both ranks
        if rank == 1:
            next(communicator._serials[communicator.group_key(g01)])
        off = tpcomm.Communicator(g01, device="cpu")
        assert "different orders" in off.disabled_reason, off.disabled_reason
        assert "[2, 3]" in off.disabled_reason, off.disabled_reason
        x = torch.full((4,), float(rank + 1))
        assert_bits_equal(off.all_reduce(x), torch.full((4,), 3.0), "fallback of a disagreeing communicator")
        off.close()
    for comm in made.values():
        comm.close()


def _body_close_barrier_is_bounded(rank, world_size):
    """close()'s meeting with the peers gives up after its timeout and names
    the ranks that did not come (a peer that died never calls close)."""
    comm = tpcomm.Communicator(device="cpu")
    if rank == 0:
        start = time.monotonic()
        missing = comm._meet_peers(1.0)
        took = time.monotonic() - start
        assert missing == list(range(1, world_size)), missing
        assert 1.0 <= took < 3.0, took
    dist.barrier()
    if rank:  # the late ranks arrive now: rank 0's mark is there, nobody is missing
        start = time.monotonic()
        assert comm._meet_peers(30.0) == []
        assert time.monotonic() - start < 10.0
    comm.close()


# ------------------------------------------------------------------- tests

def test_close_barrier_is_bounded():
    run_ranks(3, _body_close_barrier_is_bounded)


def test_serials_are_counted_per_group():
    run_ranks(3, _body_serials_per_group)


def test_two_ranks():
    run_ranks(2, _body_main)


def test_three_ranks():
    run_ranks(3, _body_main)


def test_subgroup_of_three_ranks():
    run_ranks(3, _body_subgroup)


def test_disabled_by_env():
    run_ranks(2, _body_disabled_by_env, env={"TPCOMM_DISABLE": "1"})


def test_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed"):
        tpcomm.Communicator(device="cpu")


# ---------------------------------------- routing of an enabled communicator
#
# The routing decisions are plain Python over sizes; they are checked here on
# a Communicator whose set-up is skipped and that pretends to be enabled.

# An explicit table, so these tests do not move when the shipped one is re-tuned.
TABLE = {"routes": {op: {"2": {"*": [[256 * KiB, "packet"], [16 * MiB, "bulk"]]},
                         "*": {"*": [[64 * KiB, "packet"], [16 * MiB, "bulk"]]}}
                    for op in ("all_reduce", "all_gather")}}


def _routing_comm(world_size=2, max_bytes=16 * MiB, packet_max_bytes=1 * MiB, table=TABLE, force=None, forbid=()):
    comm = object.__new__(tpcomm.Communicator)
    comm.world_size = world_size
    comm.max_bytes = max_bytes
    comm.packet_max_bytes = packet_max_bytes
    comm._routes = policy.effective_routes(policy.load_table(table), world_size, force, forbid)
    comm.handle = 0x1000  # "enabled"
    return comm


def _t(nbytes, dtype=torch.float32, shape=None):
    esize = torch.empty((), dtype=dtype).element_size()
    return torch.empty(shape or (nbytes // esize,), dtype=dtype, device="meta")


def test_shipped_bands_past_max_bytes_apply_only_to_a_larger_communicator():
    """The shipped table's last bulk band reaches 64 MiB (measured faster than
    NCCL there); a communicator's max_bytes still sends anything larger than
    it to NCCL."""
    default = _routing_comm(table=None)
    large = _routing_comm(table=None, max_bytes=128 * MiB)
    assert default.route_all_reduce(_t(64 * MiB)) == "nccl"
    assert large.route_all_reduce(_t(64 * MiB)) == "bulk"
    assert large.route_all_reduce(_t(64 * MiB + 16)) == "nccl"  # past the last band


LINE_TABLE = {"routes": {op: {"*": {"*": [[4 * KiB, "packet"], [1 * MiB, "line"], [16 * MiB, "bulk"]]}}
                         for op in ("all_reduce", "all_gather")}}


def test_route_line_kernels():
    """The line kernels take their bands where they can run (16-byte sizes,
    and rows for all_gather; up to the packet cap; CUDA builds); the packet
    kernel takes what they cannot, bulk what is over the cap."""
    c = _routing_comm(table=LINE_TABLE, packet_max_bytes=512 * KiB)
    assert c.route_all_reduce(_t(4 * KiB)) == "packet"
    assert c.route_all_reduce(_t(4 * KiB + 16)) == "line"
    assert c.route_all_reduce(_t(512 * KiB)) == "line"
    assert c.route_all_reduce(_t(512 * KiB + 16)) == "bulk"  # over the packet cap: lines live in packet slots
    assert c.route_all_gather(_t(64 * KiB), 0) == "line"
    assert c.route_all_gather(_t(64 * KiB, shape=(8192, 2)), 1) == "packet"  # 8-byte rows
    assert c.route_all_gather(_t(64 * KiB, shape=(1024, 16)), 1) == "line"  # 64-byte rows
    assert c.route_all_gather(_t(64 * KiB + 4), 0) == "packet"
    assert c.route_all_gather(_t(1 * MiB), 0) == "bulk"
    c.line_kernels = False  # a ROCm build
    assert c.route_all_reduce(_t(64 * KiB)) == "packet"
    assert c.route_all_gather(_t(64 * KiB), 0) == "packet"
    assert _routing_comm(table=LINE_TABLE, forbid=("line",)).route_all_reduce(_t(64 * KiB)) == "nccl"
    with pytest.raises(ValueError, match="reduce_scatter has no line kernel"):
        tpcomm.Config(force=(("reduce_scatter", "line"),)).checked()


def test_raw_op_auto_follows_the_routes():
    """The C core's AUTO gets the effective bands, op by op and dtype by
    dtype, band for band: line as line (packet on ROCm), NCCL bands on bulk."""
    table = {"routes": {"all_reduce": {"*": {"*": [[4 * KiB, "packet"], [1 * MiB, "line"], [8 * MiB, "nccl"]],
                                             "float32": [[64, "bulk"]]}},
                        "all_gather": {"*": {"*": [[1 * KiB, "packet"], [1 * MiB, "line"]]}}}}
    calls = {}

    class Lib:
        def tpc_comm_set_routes(self, comm, op, dtype, limits, algos, count):
            calls[(op, dtype)] = [(limits[i], algos[i]) for i in range(count)]
            return tpcomm._lib.OK

    P, L, B = tpcomm._lib.ALGO_PACKET, tpcomm._lib.ALGO_LINE, tpcomm._lib.ALGO_BULK
    for line_kernels, line in ((True, L), (False, P)):
        calls.clear()
        c = _routing_comm(table=table)
        c.line_kernels = line_kernels
        c._set_auto_routes(Lib(), None)
        ar, ag, rs = (tpcomm._lib.ROUTE_OPS[op] for op in ("all_reduce", "all_gather", "reduce_scatter"))
        star = [(4 * KiB, P), (1 * MiB, line), (8 * MiB, B)]
        assert calls[(ar, -1)] == star and calls[(ar, 2)] == star and calls[(ar, 1)] == star
        assert calls[(ar, 0)] == [(64, B)]
        assert calls[(ag, -1)] == [(1 * KiB, P), (1 * MiB, line)]
        assert calls[(rs, -1)] == [(limit, {"packet": P, "bulk": B}[b])
                                   for limit, b in policy.bands_for(policy.load_table(None), "reduce_scatter", 2)]
        assert len(calls) == 4 + 1 + 4  # all_reduce and reduce_scatter: "*" and each dtype; all_gather: "*"


def test_route_all_reduce():
    c = _routing_comm()
    assert c.enabled
    assert c.route_all_reduce(_t(16)) == "packet"
    assert c.route_all_reduce(_t(256 * KiB)) == "packet"
    assert c.route_all_reduce(_t(256 * KiB + 16)) == "bulk"
    assert c.route_all_reduce(_t(16 * MiB)) == "bulk"
    assert c.route_all_reduce(_t(16 * MiB + 16)) == "nccl"
    assert c.route_all_reduce(_t(1024, torch.bfloat16)) == "packet"
    assert c.route_all_reduce(_t(1024, torch.float16)) == "packet"
    # dtypes the kernels do not reduce, sizes they do not take
    assert c.route_all_reduce(_t(1024, torch.int64)) == "nccl"
    assert c.route_all_reduce(_t(1024, torch.float64)) == "nccl"
    assert c.route_all_reduce(_t(20)) == "nccl"
    assert c.route_all_reduce(_t(0)) == "nccl"
    # the caps of this communicator win over the table
    c = _routing_comm(max_bytes=1 * MiB, packet_max_bytes=64 * KiB)
    assert c.route_all_reduce(_t(64 * KiB)) == "packet"
    assert c.route_all_reduce(_t(128 * KiB)) == "bulk"  # table says packet, over the packet cap
    assert c.route_all_reduce(_t(1 * MiB)) == "bulk"
    assert c.route_all_reduce(_t(1 * MiB + 16)) == "nccl"
    # world size 4 uses the "other" rows
    c = _routing_comm(world_size=4)
    assert c.route_all_reduce(_t(64 * KiB)) == "packet"
    assert c.route_all_reduce(_t(64 * KiB + 16)) == "bulk"
    # disabled: always NCCL
    c.handle = 0
    assert c.route_all_reduce(_t(16)) == "nccl"


def test_route_all_gather():
    c = _routing_comm()
    assert c.route_all_gather(_t(1024, shape=(64, 4)), 0) == "packet"
    assert c.route_all_gather(_t(1024, shape=(64, 4)), 1) == "packet"
    big = (64 * KiB, 2)  # 512 KiB of fp32; rows of 8 bytes along dim 1
    assert c.route_all_gather(_t(0, shape=big), 0) == "bulk"
    assert c.route_all_gather(_t(0, shape=big), -1) == "packet"  # 8-byte rows: no bulk
    assert c.route_all_gather(_t(0, shape=(32 * KiB, 4)), 1) == "bulk"  # 16-byte rows
    # sizes or rows that are not a multiple of 4 bytes: NCCL
    assert c.route_all_gather(_t(6, torch.uint8), 0) == "nccl"
    assert c.route_all_gather(_t(0, torch.float16, shape=(4, 3)), 1) == "nccl"  # 6-byte rows
    assert c.route_all_gather(_t(0, torch.float16, shape=(4, 3)), 0) == "packet"  # 24 bytes
    assert c.route_all_gather(_t(0, torch.float16, shape=(0, 8)), 0) == "nccl"
    # over the packet cap and bulk impossible: NCCL
    c = _routing_comm(packet_max_bytes=64 * KiB)
    assert c.route_all_gather(_t(0, shape=big), -1) == "nccl"
    assert c.route_all_gather(_t(0, shape=big), 0) == "bulk"
    # bulk output over max_bytes
    c = _routing_comm(max_bytes=1 * MiB)
    assert c.route_all_gather(_t(512 * KiB), 0) == "bulk"  # 2 x 512 KiB out: fits exactly
    assert c.route_all_gather(_t(512 * KiB + 16), 0) == "packet"  # output too large: within the packet cap
    c = _routing_comm(max_bytes=1 * MiB, packet_max_bytes=256 * KiB)
    assert c.route_all_gather(_t(512 * KiB + 16), 0) == "nccl"  # neither kernel takes it
    c.handle = 0
    assert c.route_all_gather(_t(1024), 0) == "nccl"


def test_route_default_tables():
    """With the shipped table, a size the table gives to a kernel goes to
    that kernel (on a communicator whose caps hold it), and past the table to
    NCCL."""
    shipped = policy.load_table()
    for world_size in (2, 4, 8):
        c = _routing_comm(world_size=world_size, table=None, max_bytes=64 * MiB)
        for dtype in (torch.float32, torch.bfloat16):
            rows = policy.bands_for(shipped, "all_reduce", world_size, str(dtype).split(".")[1])
            for limit, backend in rows:
                assert c.route_all_reduce(_t(limit, dtype)) == backend
            assert c.route_all_reduce(_t(rows[-1][0] + 16, dtype)) == "nccl"


def test_route_per_dtype_forced_and_forbidden():
    """A dtype row of the table, a forced backend and a forbidden one."""
    table = {"routes": {"all_reduce": {"*": {"*": [[64 * KiB, "packet"], [16 * MiB, "bulk"]],
                                              "bfloat16": [[4 * KiB, "packet"], [16 * MiB, "bulk"]]}},
                        "all_gather": {"*": {"*": [[64 * KiB, "packet"], [16 * MiB, "bulk"]]}}}}
    c = _routing_comm(table=table)
    assert c.route_all_reduce(_t(8 * KiB, torch.float32)) == "packet"
    assert c.route_all_reduce(_t(8 * KiB, torch.bfloat16)) == "bulk"
    assert c.route_all_reduce(_t(8 * KiB, torch.float16)) == "packet"  # no row of its own: "*"
    c = _routing_comm(table=table, force={"all_reduce": "nccl"})
    assert c.route_all_reduce(_t(64)) == "nccl"
    assert c.route_all_gather(_t(64), 0) == "packet"  # only all_reduce was forced
    c = _routing_comm(table=table, force={"all_gather": "bulk"})
    assert c.route_all_gather(_t(64), 0) == "bulk"
    assert c.route_all_gather(_t(12), 0) == "packet"  # bulk cannot take 12 bytes: the kernel that can
    c = _routing_comm(table=table, forbid=("packet",))
    assert c.route_all_reduce(_t(1024)) == "nccl"
    assert c.route_all_reduce(_t(1 * MiB)) == "bulk"


def test_route_never_depends_on_the_pointer():
    """A view at an odd offset on one rank only must take the same route as
    the aligned tensor its peers hold (the binding copies it into an aligned
    tensor), or one rank would run the kernel while the other calls NCCL."""
    c = _routing_comm()
    base = torch.zeros(4096 + 3)
    for offset in (1, 2, 3):  # 4, 8 and 12 bytes past a 16-byte boundary
        x = base[offset:offset + 1024]
        assert x.is_contiguous() and x.data_ptr() % 16 == 4 * offset
        assert c.route_all_reduce(x) == c.route_all_reduce(torch.zeros(1024)) == "packet"
        g = base[offset:offset + 4096].view(64, 64)
        for dim in (0, 1):
            assert c.route_all_gather(g, dim) == c.route_all_gather(torch.zeros(64, 64), dim)


def test_routing_summary_logged_at_init_names_every_band():
    c = _routing_comm()
    text = c._routing_summary()
    assert "all_reduce: packet up to 262144 B, bulk up to 16777216 B, then nccl" in text
    assert "all_gather: packet up to 262144 B" in text and "caps: packet 1048576 B per rank" in text


def test_route_reduce_scatter():
    """Bands by input bytes per rank; the packet cap applies to one part."""
    table = {"routes": {"reduce_scatter": {"*": {"*": [[64 * KiB, "packet"], [16 * MiB, "bulk"]]}}}}
    c = _routing_comm(table=table, packet_max_bytes=16 * KiB)
    assert c.route_reduce_scatter(_t(32)) == "packet"            # 2 parts of 16 bytes
    assert c.route_reduce_scatter(_t(32 * KiB)) == "packet"      # parts of 16 KiB: at the packet cap
    assert c.route_reduce_scatter(_t(32 * KiB + 32)) == "bulk"   # over the packet cap per part
    assert c.route_reduce_scatter(_t(64 * KiB + 32)) == "bulk"
    assert c.route_reduce_scatter(_t(16 * MiB + 32)) == "nccl"   # over max_bytes
    assert c.route_reduce_scatter(_t(48)) == "nccl"              # parts of 24 bytes
    assert c.route_reduce_scatter(_t(1024, torch.int32)) == "nccl"
    c.handle = 0
    assert c.route_reduce_scatter(_t(32)) == "nccl"
