"""all_reduce on real GPUs, compared with NCCL bit for bit, at any world size
from 2 to 8.

Integer-valued inputs make every summation order exact, so the custom result
must equal NCCL's bits whatever the world size; on two ranks a + b has only
one rounding, so random floats must match bit for bit too. Every op runs
with a random rank late and its input overwritten right after it; every
Communicator call is checked against stats() for the backend its route
names, and the internal ops (torch.ops._tpcomm.*, algo explicit) run the
kernel they are told or raise."""
import pytest
import torch
import torch.distributed as dist

import multiproc
import tpcomm
from gpu_checks import (DTYPES, KERNELS, PACKET, Calls, KiB, MiB, all_reduce_algo, assert_bits_equal,
                        assert_custom_only, delay_random_rank, int_valued, nccl_all_gather, nccl_all_reduce,
                        no_compile_caches, overwrite, same_on_all_ranks, shared_rng, stats_label, takes)
from tpcomm import _constants
from tpcomm.reference import rank_order_sum

pytestmark = pytest.mark.gpu

CAP = 16 * MiB


def _rank_order_sum(x):
    """Every rank's x summed in fp32 in rank order, rounded once to x's dtype."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return rank_order_sum(parts).to(x.dtype)


def _sizes(gen):
    """16 B, the cap, sizes around the packet cutover and packet cap, and
    random multiples of 16 in between (all_reduce takes any multiple of 16
    at any world size)."""
    fixed = [16, 32, 64 * KiB, 256 * KiB - 16, 256 * KiB, 256 * KiB + 16, 1 * MiB, 1 * MiB + 16, CAP]
    rand = [16 * int(torch.randint(1, CAP // 16, (1,), generator=gen)) for _ in range(6)]
    rand += [16 * int(torch.randint(1, 4096, (1,), generator=gen)) for _ in range(4)]
    return sorted(set(fixed + rand))


def body_eager_matches_nccl(rank, world):
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    calls = Calls(comm)
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    size_gen = torch.Generator().manual_seed(99)  # same sizes on every rank
    rng = shared_rng(3)
    for nbytes in _sizes(size_gen):
        for dtype in DTYPES:
            x = int_valued(nbytes // dtype.itemsize, dtype, gen)
            ref = nccl_all_reduce(x)
            for algo in ("routed", "packet", "line", "two_shot", "bulk"):
                if algo != "routed" and not takes(comm, "all_reduce", algo, x):
                    continue
                xi = x.clone()
                delay_random_rank(rank, world, rng)
                if algo == "routed":
                    route = comm.route_all_reduce(xi)
                    y = comm.all_reduce(xi)
                    calls.expect("all_reduce", route)
                    assert nbytes > 64 * KiB or route in KERNELS, (nbytes, route)  # decode sizes: a kernel
                else:
                    y = torch.ops._tpcomm.all_reduce(xi, comm.comm_id, all_reduce_algo(comm, algo))
                overwrite(xi)
                assert_bits_equal(y, ref, f"{nbytes} B {dtype} {algo}")
            # in place
            z = x.clone()
            route = comm.route_all_reduce(z)
            delay_random_rank(rank, world, rng)
            assert comm.all_reduce(z, out=z) is z
            calls.expect("all_reduce", route)
            assert_bits_equal(z, ref, f"{nbytes} B {dtype} in place")
    # random floats: the fp32 sum in rank order rounded once, bit for bit, and
    # bit-exact against NCCL on 2 ranks (a + b has one order); NCCL sums more
    # ranks in an order of its own (and 16-bit types in 16 bits), so with more
    # ranks the reference is the rank-order sum itself
    for dtype in DTYPES:
        for nbytes in (64, 48 * KiB, 768 * KiB, 8 * MiB):
            x = torch.randn(nbytes // dtype.itemsize, generator=gen, device="cuda").to(dtype)
            kept = x.clone()
            route = comm.route_all_reduce(x)
            delay_random_rank(rank, world, rng)
            y = comm.all_reduce(x)
            overwrite(x)
            calls.expect("all_reduce", route)
            same_on_all_ranks(y, f"random {dtype} {nbytes} B")
            assert_bits_equal(y, _rank_order_sum(kept), f"random {dtype} {nbytes} B vs the rank-order sum")
            if world == 2:
                assert_bits_equal(y, nccl_all_reduce(kept), f"random {dtype} {nbytes} B vs NCCL")
    comm.check()
    comm.close()


def body_graph_replays(rank, world):
    """Several captured ops of both kernels, each after a random rank's
    delay, replayed 100 times with new inputs overwritten right after,
    interleaved with eager calls on the same communicator."""
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    rng = shared_rng(17)
    shapes = [(4096,), (8, 4096), (1024 * 1024,), (3 * 1024 * 1024,)]  # bf16: 8 KiB, 64 KiB, 2 MiB, 6 MiB
    static_in = [torch.zeros(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    torch.cuda.synchronize()
    calls = Calls(comm)
    graph = torch.cuda.CUDAGraph()
    with comm.capture():
        with torch.cuda.graph(graph):
            static_out = []
            for x in static_in:
                delay_random_rank(rank, world, rng)
                static_out.append(comm.all_reduce(x))
            inplace = static_in[1] * 1
            comm.all_reduce(inplace, out=inplace)
    assert sum(calls.ran("all_reduce", k) for k in KERNELS) == len(shapes) + 1, comm.stats()
    second = torch.cuda.CUDAGraph()  # a second graph, replayed in between
    small_in = torch.zeros(64, dtype=torch.float16, device="cuda")
    with comm.capture():
        with torch.cuda.graph(second):
            small_out = comm.all_reduce(small_in)
    for replay in range(100):
        kept = []
        for x in static_in:
            x.copy_(int_valued(x.numel(), x.dtype, gen).view(x.shape))
            kept.append(x.clone())
        small_in.copy_(int_valued(64, torch.float16, gen))
        small_kept = small_in.clone()
        graph.replay()
        kept_inplace = kept[1]
        for x in static_in:
            overwrite(x)
        if replay % 3 == 0:
            second.replay()
            overwrite(small_in)
            assert_bits_equal(small_out, nccl_all_reduce(small_kept), f"second graph replay {replay}")
        for k, y in zip(kept, static_out):
            assert_bits_equal(y, nccl_all_reduce(k), f"replay {replay} shape {tuple(k.shape)}")
        assert_bits_equal(inplace, nccl_all_reduce(kept_inplace), f"replay {replay} in place")
        if replay % 10 == 0:  # eager calls between replays share the device epoch
            e = int_valued(2048, torch.float32, gen)
            kept_e = e.clone()
            y = comm.all_reduce(e)
            overwrite(e)
            assert_bits_equal(y, nccl_all_reduce(kept_e), f"eager between replays {replay}")
    comm.check()
    assert_custom_only(comm, want=())
    comm.close()


def body_back_to_back_and_overwrite(rank, world):
    """50 ops queued without waiting (packet slot parity and bulk slot reuse),
    a random rank late before each, inputs overwritten right after each op
    (a missing wait would show)."""
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(11 + rank)
    rng = shared_rng(23)
    inputs, outputs = [], []
    for i in range(50):
        numel = [256, 64 * 1024, 600 * 1024, 2 * 1024 * 1024][i % 4]
        x = int_valued(numel, torch.bfloat16, gen)
        inputs.append(x.clone())
        delay_random_rank(rank, world, rng)
        outputs.append(comm.all_reduce(x))
        overwrite(x)
    for i, (x, y) in enumerate(zip(inputs, outputs)):
        assert_bits_equal(y, nccl_all_reduce(x), f"back-to-back op {i}")
    assert_custom_only(comm, want=())
    assert sum(s["calls"] for s in comm.stats().values()) == 50
    comm.close()


def body_bulk_half_and_whole(rank, world):
    """The bulk kernel queued back to back without waiting, its sizes taking
    one half of the bulk region or the whole of it in turn (from three ranks
    the two-shot's slots outgrow a half near the cap: all_reduce.cuh), a
    random rank late before each op, inputs overwritten right after each."""
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(41 + rank)
    rng = shared_rng(43)
    inputs, outputs = [], []
    for nbytes in [CAP, 1 * MiB, 1 * MiB + 16, CAP, CAP - 16, 64 * KiB, 13 * MiB, 3 * MiB] * 2:
        x = int_valued(nbytes // 2, torch.bfloat16, gen)
        inputs.append(x.clone())
        delay_random_rank(rank, world, rng)
        outputs.append(torch.ops._tpcomm.all_reduce(x, comm.comm_id, all_reduce_algo(comm, "bulk")))
        overwrite(x)
    for i, (x, y) in enumerate(zip(inputs, outputs)):
        assert_bits_equal(y, nccl_all_reduce(x), f"bulk op {i}, {2 * x.numel()} B")
    comm.check()
    comm.close()


def body_nan_inf(rank, world):
    """NaN, inf and -0.0 through the packet and bulk kernels: NaN where NCCL
    has NaN, the other elements NCCL's bits."""
    comm = tpcomm.Communicator()
    assert comm.enabled, comm.disabled_reason
    rng = shared_rng(31)
    for dtype in DTYPES:
        for numel in (64, 1 << 16):  # within the packet cap for every dtype
            x = torch.ones(numel, dtype=dtype, device="cuda")
            x[1] = float("nan") if rank == 0 else 1.0
            x[2] = float("inf")
            x[3] = float("inf") if rank == 0 else float("-inf")
            x[4] = float("-inf")
            x[5] = -0.0
            ref = nccl_all_reduce(x)
            for algo in (PACKET, all_reduce_algo(comm, "bulk")):
                xi = x.clone()
                delay_random_rank(rank, world, rng)
                y = torch.ops._tpcomm.all_reduce(xi, comm.comm_id, algo)
                overwrite(xi)
                assert torch.isnan(y[1]) and torch.isnan(y[3]), (dtype, numel, algo, y[:6])
                assert y[2] == float("inf") and y[4] == float("-inf"), (dtype, y[:6])
                assert torch.signbit(y[5]), "-0.0 + -0.0 must stay -0.0"
                assert torch.equal(torch.isnan(y), torch.isnan(ref))
                finite = ~torch.isnan(ref)
                assert_bits_equal(y[finite], ref[finite], f"nan/inf {dtype} {numel} algo {algo}")
    comm.check()
    comm.close()


def body_two_communicators(rank, world):
    """Two communicators of one group, used in turn, each with its own
    buffers and caps; stats() shows each ran its own calls on the kernels."""
    a = tpcomm.Communicator()
    b = tpcomm.Communicator(max_bytes=4 * MiB, packet_max_bytes=64 * KiB)
    assert a.enabled and b.enabled and a.comm_id != b.comm_id
    gen = torch.Generator(device="cuda").manual_seed(5 + rank)
    rng = shared_rng(37)
    for i in range(20):
        x = int_valued(8192 * (i + 1), torch.float16, gen)
        kept = x.clone()
        delay_random_rank(rank, world, rng)
        ya = a.all_reduce(x)
        yb = b.all_reduce(x)
        za = a.all_reduce(x[: 1024 * 8])
        overwrite(x)
        ref = nccl_all_reduce(kept)
        assert_bits_equal(ya, ref, f"comm a op {i}")
        assert_bits_equal(yb, ref, f"comm b op {i}")
        assert_bits_equal(za, nccl_all_reduce(kept[: 1024 * 8]), f"comm a small op {i}")
    assert_custom_only(a, want=("packet",))
    assert_custom_only(b, want=("packet",))
    assert sum(s["calls"] for s in a.stats().values()) == 40 and sum(s["calls"] for s in b.stats().values()) == 20
    a.close()
    b.close()


def body_errors(rank, world):
    """Bad input: clear exceptions or documented fallbacks; peers that
    disagree or never arrive: an error naming the peer, never a hang."""
    comm = tpcomm.Communicator(timeout_s=2.0)
    assert comm.enabled, comm.disabled_reason
    x = torch.ones(64, device="cuda")
    if torch.cuda.device_count() > 1:  # ranks sharing one GPU have no other GPU here
        other = (comm.device.index + 1) % torch.cuda.device_count()
        with pytest.raises(ValueError, match="cuda"):
            comm.all_reduce(x.to(f"cuda:{other}"))
    with pytest.raises(TypeError):
        comm.all_reduce([1.0, 2.0])
    # documented fallbacks go to NCCL, are counted there, and are still right
    calls = Calls(comm)
    fallback = stats_label(comm, "nccl")  # routes name it as stats() does: gloo where ranks share a GPU
    assert comm.route_all_reduce(torch.ones(64, dtype=torch.float64, device="cuda")) == fallback
    assert comm.route_all_reduce(torch.ones(5, device="cuda")) == fallback  # 20 bytes
    assert comm.route_all_reduce(torch.ones(17 * MiB // 4, device="cuda")) == fallback
    i = torch.arange(10, dtype=torch.int32, device="cuda")
    assert torch.equal(comm.all_reduce(i), i * world)
    t = torch.arange(64 * 64, dtype=torch.float32, device="cuda").reshape(64, 64).t()
    route = comm.route_all_reduce(t)
    assert route in KERNELS, route
    assert torch.equal(comm.all_reduce(t), t * world)  # non-contiguous: made contiguous, on the kernels
    assert calls.ran("all_reduce", "nccl") == 1 and calls.ran("all_reduce", route) == 1, comm.stats()
    # internal op misuse raises from the C core, naming what is wrong
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops._tpcomm.all_reduce(torch.ones(5, device="cuda"), comm.comm_id, PACKET)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        torch.ops._tpcomm.all_reduce(torch.ones(8, dtype=torch.float64, device="cuda"), comm.comm_id, PACKET)
    with pytest.raises(RuntimeError, match="over the"):
        torch.ops._tpcomm.all_reduce(torch.ones(2 * MiB // 4, device="cuda"), comm.comm_id, PACKET)
    unknown = 1 + max(v for k, v in vars(_constants).items() if k.startswith("TPC_ALGO_"))
    for bad in (0, unknown, -1):  # no automatic choice (0) in the C core, nor a code past the header's
        with pytest.raises(RuntimeError, match=f"algorithm {bad}"):
            torch.ops._tpcomm.all_reduce(x, comm.comm_id, bad)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        torch.ops._tpcomm.all_reduce(torch.ones(64), comm.comm_id, PACKET)

    # peers disagree on the size: both ranks get an error naming the other
    mismatched = torch.ones(64 if rank == 0 else 128, device="cuda")
    comm.all_reduce(mismatched)
    torch.cuda.synchronize()
    with pytest.raises(tpcomm.TpcommError, match=f"peer {1 - rank if world == 2 else ''}"):
        comm.check()
    with pytest.raises(RuntimeError):  # and it refuses further work
        comm.all_reduce(x)
    comm.close()
    # the same over several blocks of packets (32 and 64 KiB), where headers are
    # checked inside the first data wait beside the peers' packets
    folded = tpcomm.Communicator(timeout_s=2.0)
    torch.ops._tpcomm.all_reduce(torch.ones(8192 if rank == 0 else 16384, device="cuda"), folded.comm_id, PACKET)
    torch.cuda.synchronize()
    with pytest.raises(tpcomm.CollectiveMismatch, match=f"peer {1 - rank if world == 2 else ''}"):
        folded.check()
    folded.close()

    # a peer that never arrives: bounded wait, error names it
    late = tpcomm.Communicator(timeout_s=1.0)
    assert late.route_all_reduce(torch.ones(1024, device="cuda")) in KERNELS
    if rank == 0:
        late.all_reduce(torch.ones(1024, device="cuda"))
        torch.cuda.synchronize()  # returns after ~1 s instead of hanging
        with pytest.raises(tpcomm.TpcommError, match="peer 1 did not arrive"):
            late.check()
    dist.barrier()
    late.close()

    closed = tpcomm.Communicator()
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.all_reduce(x)


class _CountingFastpath:
    """tpcomm._fastpath with its all_reduce calls counted."""

    def __init__(self, fast):
        self.fast, self.calls = fast, 0

    def all_reduce(self, *args):
        self.calls += 1
        return self.fast.all_reduce(*args)


def body_eager_fast_path(rank, world):
    """Communicator.all_reduce calls the C core directly (tpcomm._fastpath)
    for aligned tensors, on any stream and under capture, and the torch op for
    misaligned views: both give NCCL's bits, with a random rank delayed and
    every input overwritten right after its op."""
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    assert tpcomm._lib.fastpath() is not None, "tpcomm._fastpath was not built"
    counting = comm.kernels._fastpath = _CountingFastpath(comm.kernels._fastpath)
    gen = torch.Generator(device="cuda").manual_seed(21 + rank)
    rng = shared_rng(8)
    side = torch.cuda.Stream()
    expected_fast = 0
    calls = Calls(comm)
    for i, nbytes in enumerate((64, 2 * KiB, 48 * KiB, 512 * KiB, 4 * MiB)):
        for dtype in DTYPES:
            x = int_valued(nbytes // dtype.itemsize, dtype, gen)
            kept = x.clone()
            route = comm.route_all_reduce(kept)
            assert route in KERNELS, route
            delay_random_rank(rank, world, rng, max_us=100)
            stream = side if i % 2 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                y = comm.all_reduce(x)
                overwrite(x)
            torch.cuda.current_stream().wait_stream(stream)
            expected_fast += 1
            calls.expect("all_reduce", route)
            assert_bits_equal(y, nccl_all_reduce(kept), f"fast path {nbytes} B {dtype}")
            # a view 4 bytes past an aligned start: the op path, which copies it
            base = int_valued(nbytes // dtype.itemsize + 8, dtype, gen)
            view = base[4 // dtype.itemsize:][: nbytes // dtype.itemsize]
            assert view.data_ptr() % 16
            kept_view = view.clone()
            y = comm.all_reduce(view)
            overwrite(base)
            calls.expect("all_reduce", route)
            assert_bits_equal(y, nccl_all_reduce(kept_view), f"misaligned {nbytes} B {dtype}")
            out = torch.empty(nbytes // dtype.itemsize + 8, dtype=dtype, device="cuda")[4 // dtype.itemsize:]
            out = out[: nbytes // dtype.itemsize]
            kept = x.copy_(int_valued(x.numel(), dtype, gen)).clone()
            comm.all_reduce(x, out=out)
            overwrite(x)
            calls.expect("all_reduce", route)
            assert_bits_equal(out, nccl_all_reduce(kept), f"misaligned out {nbytes} B {dtype}")
    assert counting.calls == expected_fast, (counting.calls, expected_fast)
    # captured: the graph holds the kernel the fast path launched
    static = torch.zeros(4096, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        captured = comm.all_reduce(static)
    assert counting.calls == expected_fast + 1
    for replay in range(5):
        static.copy_(int_valued(4096, torch.bfloat16, gen))
        kept = static.clone()
        graph.replay()
        overwrite(static)
        assert_bits_equal(captured, nccl_all_reduce(kept), f"captured fast path, replay {replay}")
    comm.check()
    comm.close()
    # a closed communicator: the fast path's error, as the op's
    with pytest.raises(tpcomm.CommunicatorClosed):
        comm.all_reduce(static)
    with pytest.raises(RuntimeError, match=r"closed.*\[tpc_result 8\]"):
        counting.fast.all_reduce(comm._last_comm_id, static.data_ptr(), captured.data_ptr(), 8192, 2, PACKET, 0)


def body_sizes_for_any_world(rank, world):
    """Sizes that are multiples of 16 bytes but not of 16 * world: the
    kernels that split the work among the ranks still take them."""
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(90 + rank)
    rng = shared_rng(41)
    for nbytes in (16 * (world + 1), 4 * KiB * world + 16, 1 * MiB + 16 * (world + 1), 3 * MiB + 16):
        for algo in KERNELS:
            x = int_valued(nbytes // 2, torch.bfloat16, gen)
            if not takes(comm, "all_reduce", algo, x):
                continue
            kept = x.clone()
            delay_random_rank(rank, world, rng)
            y = torch.ops._tpcomm.all_reduce(x, comm.comm_id, all_reduce_algo(comm, algo))
            overwrite(x)
            assert_bits_equal(y, nccl_all_reduce(kept), f"{nbytes} B on {algo} at {world} ranks")
    comm.check()
    comm.close()


def body_line_kernels_in_place_and_mismatch(rank, world):
    """The kernels of 128-byte lines in place (in == out: two_shot writes a
    chunk's sums over the input it still sends from), and ranks that disagree
    on the size: an error on every rank, never a hang or a result."""
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(95 + rank)
    rng = shared_rng(96)
    for nbytes in (448 * world + 16, 64 * KiB + 16 * world, 1 * MiB):  # one step a rank, uneven chunks, the cap
        for algo in ("line", "two_shot"):
            x = int_valued(nbytes // 2, torch.bfloat16, gen)
            if not takes(comm, "all_reduce", algo, x):
                continue
            ref = nccl_all_reduce(x)
            delay_random_rank(rank, world, rng)
            torch.ops._tpcomm.all_reduce_out(x, x, comm.comm_id, all_reduce_algo(comm, algo))
            assert_bits_equal(x, ref, f"{nbytes} B on {algo} in place at {world} ranks")
    comm.check()
    comm.close()
    for algo in ("line", "two_shot"):
        bad = tpcomm.Communicator(max_bytes=CAP, timeout_s=2.0)
        x = torch.ones((32 * KiB if rank == 0 else 64 * KiB) // 2, dtype=torch.bfloat16, device="cuda")
        torch.ops._tpcomm.all_reduce(x, bad.comm_id, all_reduce_algo(comm, algo))
        torch.cuda.synchronize()  # returns: every wait is bounded
        with pytest.raises(tpcomm.TpcommError):
            bad.check()
        bad.close()


def _custom_ops_model(name):
    """Every public op, in model code: y = custom_all_reduce(x), g its
    gather along the last dim, s g's reduce-scatter back, then the fused
    all-reduce + residual + RMSNorm of s."""
    def model(x, residual, weight):
        y = torch.ops.tpcomm.custom_all_reduce(x, name)
        g = torch.ops.tpcomm.custom_all_gather(y, -1, name)
        s = torch.ops.tpcomm.custom_reduce_scatter(g, -1, name)
        normed, z = torch.ops.tpcomm.custom_all_reduce_add_rms_norm(s, residual, weight, 1e-6, name)
        return y, g, s, normed, z
    return model


def body_custom_ops_graphs_and_compile(rank, world):
    """The custom_* ops eager (each checked against NCCL, the fused one
    against the Communicator's method), captured in a CUDA graph replayed 20
    times and compiled with fullgraph=True: graph and compiled outputs equal
    the eager ones bit for bit, and stats() shows each op on a kernel."""
    comm = tpcomm.Communicator()
    assert comm.enabled, comm.disabled_reason
    model = _custom_ops_model(comm.group_name)
    gen = torch.Generator(device="cuda").manual_seed(23 + rank)
    rng = shared_rng(29)
    shape = (8, 512)

    def inputs():
        return (int_valued(8 * 512, torch.bfloat16, gen).view(shape),
                int_valued(8 * 512, torch.bfloat16, gen).view(shape),
                torch.linspace(0.5, 1.5, 512, device="cuda").to(torch.bfloat16))

    x, r, w = inputs()
    kept = (x.clone(), r.clone(), w)
    assert comm.route_all_reduce_add_rms_norm(x, w) == "fused"  # a decode size: one kernel
    calls = Calls(comm)
    delay_random_rank(rank, world, rng)
    eager = model(x, r, w)
    overwrite(x)
    y, g, s, normed, z = eager
    assert_bits_equal(y, nccl_all_reduce(kept[0]), "custom_all_reduce")
    assert_bits_equal(g, nccl_all_gather(y, -1), "custom_all_gather")
    # every rank's part of g is y: the sum is world * y, in fp32 rounded once (the kernels' numerics)
    assert_bits_equal(s, (y.float() * world).to(y.dtype), "custom_reduce_scatter")
    ref_normed, ref_z = comm.all_reduce_add_rms_norm(s, kept[1], w, 1e-6)
    assert_bits_equal(z, ref_z, "custom_all_reduce_add_rms_norm z")
    assert_bits_equal(normed, ref_normed, "custom_all_reduce_add_rms_norm normed")
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert sum(calls.ran(op, k) for k in KERNELS) == 1, (op, comm.stats())
    assert calls.ran("all_reduce_add_rms_norm", comm.route_all_reduce_add_rms_norm(s, w)) == 2, comm.stats()

    static = [t.clone() for t in inputs()]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        static_out = model(*static)
    for replay in range(20):
        fresh = inputs()
        for t, f in zip(static, fresh):
            t.copy_(f)
        want = model(*fresh)
        delay_random_rank(rank, world, rng)
        graph.replay()
        overwrite(static[0])
        overwrite(static[1])
        for i, (a, b) in enumerate(zip(static_out, want)):
            assert_bits_equal(a, b, f"graph replay {replay} output {i}")

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for step in range(3):
        fresh = inputs()
        want = model(*fresh)
        before = Calls(comm)
        with no_compile_caches():
            got = compiled(*fresh)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_bits_equal(a, b, f"compiled step {step} output {i}")
        assert sum(before.ran("all_reduce", k) for k in KERNELS) >= 1, comm.stats()
    assert stats_label(comm, "nccl") not in {b for _, b in comm.stats()}, comm.stats()
    comm.check()
    comm.close()


def body_group_of_one(rank, world):
    """A new_group of one rank on a GPU: every op and custom_* op a copy made
    with no kernel and no buffers, eager, in a CUDA graph and compiled."""
    groups = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    before = torch.cuda.memory_allocated()
    comm = tpcomm.Communicator(groups[rank])
    assert comm.world_size == 1 and not comm.enabled and comm.disabled_reason == "single rank", repr(comm)
    assert "single rank" in repr(comm) and comm.comm_id == 0 and comm._comm is None
    assert torch.cuda.memory_allocated() == before
    gen = torch.Generator(device="cuda").manual_seed(31 + rank)
    x = int_valued(8 * 512, torch.bfloat16, gen).view(8, 512)
    r = int_valued(8 * 512, torch.bfloat16, gen).view(8, 512)
    w = torch.ones(512, dtype=torch.bfloat16, device="cuda")
    model = _custom_ops_model(comm.group_name)
    y, g, s, normed, z = model(x, r, w)
    for t, what in ((y, "all_reduce"), (g, "all_gather"), (s, "reduce_scatter")):
        assert_bits_equal(t, x, what)
        assert t.data_ptr() != x.data_ptr()
    assert_bits_equal(z, (x.float() + r.float()).to(torch.bfloat16), "add_rms_norm z")  # s is x
    assert comm.custom_all_reduce(x) is None and comm.custom_all_gather(x) is None and not comm.should_custom_ar(x)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        out = torch.ops.tpcomm.custom_all_reduce(static, comm.group_name)
    static.copy_(r)
    graph.replay()
    assert_bits_equal(out, r, "graph replay on a group of one")
    torch._dynamo.reset()
    with no_compile_caches():
        got = torch.compile(model, fullgraph=True)(x, r, w)
    for a, b in zip(got, (y, g, s, normed, z)):
        assert_bits_equal(a, b, "compiled on a group of one")
    assert {b for _, b in comm.stats()} == {"single rank"}, comm.stats()
    comm.close()


@pytest.mark.parametrize("body", [body_eager_matches_nccl, body_graph_replays, body_back_to_back_and_overwrite,
                                  body_bulk_half_and_whole, body_nan_inf, body_two_communicators, body_errors,
                                  body_eager_fast_path, body_sizes_for_any_world,
                                  body_line_kernels_in_place_and_mismatch, body_custom_ops_graphs_and_compile,
                                  body_group_of_one],
                         ids=lambda f: f.__name__[5:])
def test_all_reduce(body):
    multiproc.run_gpu(body)
