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

    # routing: everything goes to torch.distributed on CPU, whatever the size,
    # named as stats() counts it: by the group's backend
    for n in (4, 64, 256 * KiB // 4, MiB // 4):
        assert comm.route_all_reduce(torch.empty(n)) == "gloo"
    assert ("all_reduce", comm.route_all_reduce(x)) in comm.stats(), comm.stats()


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
                assert comm.route_all_gather(x, dim) == "gloo"
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
                assert comm.route_reduce_scatter(x) == "gloo"
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
    assert comm.comm_id == 0
    assert reason_needle in comm.disabled_reason, comm.disabled_reason
    assert "gloo only" in repr(comm)
    comm.check()  # nothing to check without the custom path
    # every rank holds the same verdict, each naming itself where it has the reason
    verdicts = [None] * comm.world_size
    dist.all_gather_object(verdicts, (comm.enabled, comm.disabled_reason.split(": ", 1)[1]), group=comm.group)
    assert len(set(verdicts)) == 1, verdicts


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
    assert comm.disabled_reason == f"rank {rank}: device is cpu: the custom kernels need CUDA GPUs"
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
    assert comm.disabled_reason == f"rank {rank}: disabled by TPCOMM_DISABLE (or Config.disable)"
    y = comm.all_reduce(torch.full((8,), float(rank + 1)))
    assert_bits_equal(y, torch.full((8,), float(world_size * (world_size + 1) // 2)), "all_reduce when disabled")
    comm.close()


def _body_serials_per_group(rank, world_size):
    """Creation numbers are counted per group: rank 0 belongs to {0,1} and
    {0,2} and creates their communicators in the opposite order from the
    order in which the groups were made; each group's ranks still agree. A
    rank whose count on a group really is off is told so."""
    from tpcomm import _group_setup

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
            next(_group_setup.serials[_group_setup.group_key(g01)])
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
    from tpcomm import _group_setup

    comm = tpcomm.Communicator(device="cpu")
    prefix = "tpcomm/test/close-barrier"
    if rank == 0:
        start = time.monotonic()
        missing = _group_setup.meet_peers(comm.group, rank, prefix, 1.0)
        took = time.monotonic() - start
        assert missing == list(range(1, world_size)), missing
        assert 1.0 <= took < 3.0, took
    dist.barrier()
    if rank:  # the late ranks arrive now: rank 0's mark is there, nobody is missing
        start = time.monotonic()
        assert _group_setup.meet_peers(comm.group, rank, prefix, 30.0) == []
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
