"""custom_all_reduce on real GPUs, compared with NCCL bit for bit.

Integer-valued inputs make every summation order exact, so the custom result
must equal NCCL's bits whatever the world size; on two ranks a + b has only
one rounding, so random floats must match bit for bit too."""
import pytest
import torch
import torch.distributed as dist

import multiproc
import tpcomm
from tpcomm.reference import rank_order_sum

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KiB, MiB = 1024, 1024 * 1024
CAP = 16 * MiB
# raw ops with the algorithm forced, and with 0: the C core's AUTO, which follows the Communicator's routes
ALGOS = {"packet": tpcomm._lib.ALGO_PACKET, "line": tpcomm._lib.ALGO_LINE, "bulk": tpcomm._lib.ALGO_BULK,
         "raw auto": tpcomm._lib.ALGO_AUTO}


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_bits_equal(a, b, what):
    if not torch.equal(_bits(a), _bits(b)):
        diff = (_bits(a) != _bits(b)).nonzero()
        raise AssertionError(f"{what}: {diff.numel()} elements differ, first at {diff[:4].tolist()}: "
                             f"{a.flatten()[diff[:4, 0]].tolist()} vs {b.flatten()[diff[:4, 0]].tolist()}")


def _nccl(x):
    y = x.clone()
    dist.all_reduce(y)
    return y


def _rank_order_sum(x):
    """Every rank's x summed in fp32 in rank order, rounded once to x's dtype."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return rank_order_sum(parts).to(x.dtype)


def _int_valued(numel, dtype, gen):
    return torch.randint(-8, 9, (numel,), generator=gen, device="cuda").to(dtype)


def _same_on_all_ranks(t, what):
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    for r, g in enumerate(gathered):
        _assert_bits_equal(g, gathered[0], f"{what}: rank {r} differs from rank 0")


def _sizes(gen):
    """16 B, the cap, sizes around the packet cutover and packet cap, and
    random multiples of 16 in between."""
    fixed = [16, 32, 64 * KiB, 256 * KiB - 16, 256 * KiB, 256 * KiB + 16, 1 * MiB, 1 * MiB + 16, CAP]
    rand = [16 * int(torch.randint(1, CAP // 16, (1,), generator=gen)) for _ in range(6)]
    rand += [16 * int(torch.randint(1, 4096, (1,), generator=gen)) for _ in range(4)]
    return sorted(set(fixed + rand))


def body_eager_matches_nccl(rank, world):
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    size_gen = torch.Generator().manual_seed(99)  # same sizes on every rank
    checked = 0
    for nbytes in _sizes(size_gen):
        for dtype in DTYPES:
            numel = nbytes // dtype.itemsize
            x = _int_valued(numel, dtype, gen)
            ref = _nccl(x)
            for algo in ("auto", "raw auto", "packet", "line", "bulk"):
                if algo in ("packet", "line") and nbytes > comm.packet_max_bytes:
                    continue
                if algo == "auto":
                    y = comm.all_reduce(x)
                else:
                    y = torch.ops.tpcomm.custom_all_reduce(x, comm.handle, ALGOS[algo])
                _assert_bits_equal(y, ref, f"{nbytes} B {dtype} {algo}")
                checked += 1
            # in place
            z = x.clone()
            comm.all_reduce(z, out=z)
            _assert_bits_equal(z, ref, f"{nbytes} B {dtype} in place")
    # random floats: the fp32 sum in rank order rounded once, bit for bit, and
    # bit-exact against NCCL on 2 ranks (a + b has one order); NCCL sums more
    # ranks in an order of its own (and 16-bit types in 16 bits), so with more
    # ranks the reference is the rank-order sum itself
    for dtype in DTYPES:
        for nbytes in (64, 48 * KiB, 768 * KiB, 8 * MiB):
            x = torch.randn(nbytes // dtype.itemsize, generator=gen, device="cuda").to(dtype)
            y = comm.all_reduce(x)
            _same_on_all_ranks(y, f"random {dtype} {nbytes} B")
            _assert_bits_equal(y, _rank_order_sum(x), f"random {dtype} {nbytes} B vs the rank-order sum")
            if world == 2:
                _assert_bits_equal(y, _nccl(x), f"random {dtype} {nbytes} B vs NCCL")
    assert checked > 60
    comm.close()


def body_graph_replays(rank, world):
    """Several captured ops of both kernels, replayed 100 times with new
    inputs, interleaved with eager calls on the same communicator."""
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    shapes = [(4096,), (8, 4096), (1024 * 1024,), (3 * 1024 * 1024,)]  # bf16: 8 KiB, 64 KiB, 2 MiB, 6 MiB
    static_in = [torch.zeros(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture():
        with torch.cuda.graph(graph):
            static_out = [comm.all_reduce(x) for x in static_in]
            inplace = static_in[1] * 1
            comm.all_reduce(inplace, out=inplace)
    second = torch.cuda.CUDAGraph()  # a second graph, replayed in between
    small_in = torch.zeros(64, dtype=torch.float16, device="cuda")
    with comm.capture():
        with torch.cuda.graph(second):
            small_out = comm.all_reduce(small_in)
    for replay in range(100):
        for x in static_in:
            x.copy_(_int_valued(x.numel(), x.dtype, gen).view(x.shape))
        small_in.copy_(_int_valued(64, torch.float16, gen))
        graph.replay()
        if replay % 3 == 0:
            second.replay()
            _assert_bits_equal(small_out, _nccl(small_in), f"second graph replay {replay}")
        for x, y in zip(static_in, static_out):
            _assert_bits_equal(y, _nccl(x), f"replay {replay} shape {tuple(x.shape)}")
        _assert_bits_equal(inplace, _nccl(static_in[1]), f"replay {replay} in place")
        if replay % 10 == 0:  # eager calls between replays share the device epoch
            e = _int_valued(2048, torch.float32, gen)
            _assert_bits_equal(comm.all_reduce(e), _nccl(e), f"eager between replays {replay}")
    comm.check()
    comm.close()


def body_back_to_back_and_overwrite(rank, world):
    """50 ops queued without waiting (packet slot parity and bulk slot reuse),
    inputs overwritten right after each op (a missing wait would show)."""
    comm = tpcomm.Communicator(max_bytes=CAP)
    gen = torch.Generator(device="cuda").manual_seed(11 + rank)
    inputs, outputs = [], []
    for i in range(50):
        numel = [256, 64 * 1024, 600 * 1024, 2 * 1024 * 1024][i % 4]
        x = _int_valued(numel, torch.bfloat16, gen)
        inputs.append(x.clone())
        outputs.append(comm.all_reduce(x))
        x.fill_(float("nan"))  # overwrite the input immediately
    for i, (x, y) in enumerate(zip(inputs, outputs)):
        _assert_bits_equal(y, _nccl(x), f"back-to-back op {i}")
    comm.close()


def body_nan_inf(rank, world):
    comm = tpcomm.Communicator()
    for dtype in DTYPES:
        for numel in (64, 1 << 16):  # within the packet cap for every dtype
            x = torch.ones(numel, dtype=dtype, device="cuda")
            x[1] = float("nan") if rank == 0 else 1.0
            x[2] = float("inf")
            x[3] = float("inf") if rank == 0 else float("-inf")
            x[4] = float("-inf")
            x[5] = -0.0
            for algo in (tpcomm._lib.ALGO_PACKET, tpcomm._lib.ALGO_BULK):
                y = torch.ops.tpcomm.custom_all_reduce(x, comm.handle, algo)
                ref = _nccl(x)
                assert torch.isnan(y[1]) and torch.isnan(y[3]), (dtype, numel, algo, y[:6])
                assert y[2] == float("inf") and y[4] == float("-inf"), (dtype, y[:6])
                assert torch.signbit(y[5]), "-0.0 + -0.0 must stay -0.0"
                assert torch.equal(torch.isnan(y), torch.isnan(ref))
                finite = ~torch.isnan(ref)
                _assert_bits_equal(y[finite], ref[finite], f"nan/inf {dtype} {numel} algo {algo}")
    comm.close()


def body_two_communicators(rank, world):
    a = tpcomm.Communicator()
    b = tpcomm.Communicator(max_bytes=4 * MiB, packet_max_bytes=64 * KiB)
    assert a.enabled and b.enabled and a.handle != b.handle
    gen = torch.Generator(device="cuda").manual_seed(5 + rank)
    for i in range(20):
        x = _int_valued(8192 * (i + 1), torch.float16, gen)
        ya = a.all_reduce(x)
        yb = b.all_reduce(x)
        za = a.all_reduce(x[: 1024 * 8])
        ref = _nccl(x)
        _assert_bits_equal(ya, ref, f"comm a op {i}")
        _assert_bits_equal(yb, ref, f"comm b op {i}")
        _assert_bits_equal(za, _nccl(x[: 1024 * 8]), f"comm a small op {i}")
    a.close()
    b.close()


def body_errors(rank, world):
    """Bad input: clear exceptions or documented fallbacks; peers that
    disagree or never arrive: an error naming the peer, never a hang."""
    comm = tpcomm.Communicator(timeout_s=2.0)
    x = torch.ones(64, device="cuda")
    if torch.cuda.device_count() > 1:  # a one-GPU run (harness.one_gpu_mode) has no other GPU
        other = (comm.device.index + 1) % torch.cuda.device_count()
        with pytest.raises(ValueError, match="cuda"):
            comm.all_reduce(x.to(f"cuda:{other}"))
    with pytest.raises(TypeError):
        comm.all_reduce([1.0, 2.0])
    # documented fallbacks go to NCCL and are still right
    assert comm.route_all_reduce(torch.ones(64, dtype=torch.float64, device="cuda")) == "nccl"
    assert comm.route_all_reduce(torch.ones(5, device="cuda")) == "nccl"  # 20 bytes
    assert comm.route_all_reduce(torch.ones(17 * MiB // 4, device="cuda")) == "nccl"
    i = torch.arange(10, dtype=torch.int32, device="cuda")
    assert torch.equal(comm.all_reduce(i), i * world)
    t = torch.arange(64 * 64, dtype=torch.float32, device="cuda").reshape(64, 64).t()
    assert torch.equal(comm.all_reduce(t), t * world)  # non-contiguous: made contiguous
    # raw op misuse raises from the C core
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.tpcomm.custom_all_reduce(torch.ones(5, device="cuda"), comm.handle, 0)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        torch.ops.tpcomm.custom_all_reduce(torch.ones(8, dtype=torch.float64, device="cuda"), comm.handle, 0)
    with pytest.raises(RuntimeError, match="over the"):
        torch.ops.tpcomm.custom_all_reduce(torch.ones(2 * MiB // 4, device="cuda"), comm.handle, tpcomm._lib.ALGO_PACKET)

    # peers disagree on the size: both ranks get an error naming the other
    mismatched = torch.ones(64 if rank == 0 else 128, device="cuda")
    comm.all_reduce(mismatched)
    torch.cuda.synchronize()
    with pytest.raises(tpcomm.TpcommError, match=f"peer {1 - rank if world == 2 else ''}"):
        comm.check()
    with pytest.raises(RuntimeError):  # and it refuses further work
        comm.all_reduce(x)
    comm.close()

    # a peer that never arrives: bounded wait, error names it
    late = tpcomm.Communicator(timeout_s=1.0)
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
    delay_gen = torch.Generator().manual_seed(8)  # the same draws on every rank
    side = torch.cuda.Stream()
    expected_fast = 0
    for i, nbytes in enumerate((64, 2 * KiB, 48 * KiB, 512 * KiB, 4 * MiB)):
        for dtype in DTYPES:
            x = _int_valued(nbytes // dtype.itemsize, dtype, gen)
            kept = x.clone()
            late = int(torch.randint(0, world, (1,), generator=delay_gen))
            if rank == late:
                torch.cuda._sleep(200_000)  # ~0.1 ms: the other ranks arrive first
            stream = side if i % 2 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                y = comm.all_reduce(x)
                x.fill_(float("nan"))
            torch.cuda.current_stream().wait_stream(stream)
            expected_fast += 1
            assert comm.route_all_reduce(kept) in ("packet", "line", "bulk")
            _assert_bits_equal(y, _nccl(kept), f"fast path {nbytes} B {dtype}")
            # a view 4 bytes past an aligned start: the op path, which copies it
            base = _int_valued(nbytes // dtype.itemsize + 8, dtype, gen)
            view = base[4 // dtype.itemsize:][: nbytes // dtype.itemsize]
            assert view.data_ptr() % 16
            _assert_bits_equal(comm.all_reduce(view), _nccl(view.clone()), f"misaligned {nbytes} B {dtype}")
            out = torch.empty(nbytes // dtype.itemsize + 8, dtype=dtype, device="cuda")[4 // dtype.itemsize:]
            out = out[: nbytes // dtype.itemsize]
            kept = x.copy_(_int_valued(x.numel(), dtype, gen)).clone()
            comm.all_reduce(x, out=out)
            _assert_bits_equal(out, _nccl(kept), f"misaligned out {nbytes} B {dtype}")
    assert counting.calls == expected_fast, (counting.calls, expected_fast)
    # captured: the graph holds the kernel the fast path launched
    static = torch.zeros(4096, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        captured = comm.all_reduce(static)
    assert counting.calls == expected_fast + 1
    for replay in range(5):
        static.copy_(_int_valued(4096, torch.bfloat16, gen))
        graph.replay()
        _assert_bits_equal(captured, _nccl(static), f"captured fast path, replay {replay}")
    comm.check()
    comm.close()
    # a closed communicator: the fast path's error, as the op's
    with pytest.raises(tpcomm.CommunicatorClosed):
        comm.all_reduce(static)
    with pytest.raises(RuntimeError, match=r"closed.*\[tpc_result 8\]"):
        counting.fast.all_reduce(comm._id, static.data_ptr(), captured.data_ptr(), 8192, 2,
                                 tpcomm._lib.ALGO_PACKET, 0)


@pytest.mark.parametrize("body", [body_eager_matches_nccl, body_graph_replays, body_back_to_back_and_overwrite,
                                  body_nan_inf, body_two_communicators, body_errors, body_eager_fast_path],
                         ids=lambda f: f.__name__[5:])
def test_all_reduce(body):
    multiproc.run_gpu(body)
