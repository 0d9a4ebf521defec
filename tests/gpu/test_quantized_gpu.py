"""The quantized all-reduce (fp8, int8, int4) on real GPUs, at any world size
2..8 (ranks may share one GPU: TPCOMM_SHARE_GPU=1 TPCOMM_TEST_WORLD=N).

Every rank draws every rank's input from one seed (tests/quantized_data.py:
uniform, Student-t, an outlier group, all-zero), so each holds the kernel's
result against the whole group's references: every element within the error
bound docs/design.md derives, against the fp64 sum
(tpcomm.quantized_reference.bound); the bits of the CPU emulation
(quantized_reference.emulate); the same bits on every rank and on a second
run of the same input. A random rank is late before every op and inputs are
overwritten right after it; stats() proves the quantized route ran."""
import pytest
import torch

import multiproc
import quantized_data
import tpcomm
from gpu_checks import KiB, MiB, Calls, assert_bits_equal, delay_random_rank, overwrite, same_on_all_ranks, shared_rng
from tpcomm import _constants as C
from tpcomm import quantized_reference as ref

pytestmark = pytest.mark.gpu

CAP = 16 * MiB
DTYPES = (torch.bfloat16, torch.float16)
ALGO = {"fp8": C.TPC_ALGO_QUANTIZED_FP8, "int8": C.TPC_ALGO_QUANTIZED_INT8, "int4": C.TPC_ALGO_QUANTIZED_INT4}


def _group_inputs(kind, world, nbytes, dtype, seed):
    return quantized_data.inputs(kind, world, nbytes // dtype.itemsize, dtype, seed)


def _check(y, xs, mode, what):
    """y (this rank's result) within the bound of the fp64 sum, with the
    emulation's bits, and the same bits on every rank."""
    y = y.cpu()
    limit, exact = ref.bound(xs, mode)
    err = (y.double() - exact).abs()
    over = ~(err <= limit)
    assert not over.any(), (f"{what}: {int(over.sum())} of {y.numel()} values over the bound, first at "
                            f"{int(over.nonzero()[0])}: {float(y[over][0])} vs exact {float(exact[over][0])} "
                            f"(bound {float(limit[over][0])})")
    assert_bits_equal(y, ref.emulate(xs, mode), f"{what}: the emulation's bits")
    same_on_all_ranks(y.cuda(), what)


def _sizes(world):
    """The routed minimum and sizes past it (odd numbers of units, last
    groups short, chunks not whole steps), and small sizes through the
    internal op: a unit, a group, fewer units than ranks."""
    routed = [1 * MiB, 1 * MiB + 48, 3 * MiB + 16 * 1001]
    direct = [16, 48, 64, 16 * world, 1040, 64 * KiB + 16]
    return routed, direct


def body_within_bound_same_bits(rank, world):
    rng = shared_rng(7)
    for mode in ref.MODES:
        comm = tpcomm.Communicator(max_bytes=CAP, config=tpcomm.Config(quantize=mode))
        assert comm.enabled, comm.disabled_reason
        calls = Calls(comm)
        routed, direct = _sizes(world)
        seed = 0
        for dtype in DTYPES:
            for kind in quantized_data.KINDS:
                for nbytes in routed + direct:
                    seed += 1
                    xs = _group_inputs(kind, world, nbytes, dtype, seed)
                    x = xs[rank].cuda()
                    what = f"{mode} {dtype} {kind} {nbytes} B at {world} ranks"
                    results = []
                    for _ in range(2):  # the same input twice: the same bits
                        xi = x.clone()
                        delay_random_rank(rank, world, rng)
                        if nbytes in routed:
                            assert comm.route_all_reduce(xi) == f"quantized_{mode}", what
                            y = comm.all_reduce(xi)
                            overwrite(xi)
                            calls.expect("all_reduce", f"quantized_{mode}")
                        else:
                            y = torch.ops._tpcomm.all_reduce(xi, comm.comm_id, ALGO[mode])
                            overwrite(xi)
                        results.append(y)
                    _check(results[0], xs, mode, what)
                    assert_bits_equal(results[1], results[0], f"{what}: a second run")
        comm.check()
        comm.close()


def body_in_place_back_to_back(rank, world):
    """Ops queued without waiting, the modes in turn and sizes that take a
    half of the bulk region or the whole of it (up to the cap), in place
    (out is the input), a random rank late before each; checked after."""
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    rng = shared_rng(17)
    cases, outputs = [], []
    sizes = [CAP, 1 * MiB, 2 * MiB + 16, CAP - 16, 64 * KiB, 13 * MiB, 16]
    for i in range(2 * len(sizes)):  # every size in two modes
        mode, nbytes = ref.MODES[i % 3], sizes[i % len(sizes)]
        xs = _group_inputs("student_t", world, nbytes, torch.bfloat16, 100 + i)
        x = xs[rank].cuda()
        delay_random_rank(rank, world, rng)
        torch.ops._tpcomm.all_reduce_out(x, x, comm.comm_id, ALGO[mode])
        cases.append((xs, mode, nbytes))
        outputs.append(x)
    for (xs, mode, nbytes), y in zip(cases, outputs):
        _check(y, xs, mode, f"back-to-back {mode} {nbytes} B in place")
    comm.check()
    comm.close()


def body_nan_inf_poison_their_group(rank, world):
    """A NaN or +-inf in one rank's input makes its group NaN on every rank,
    and no other value: the rest has the emulation's bits."""
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    rng = shared_rng(5)
    for mode in ref.MODES:
        for bad in (float("nan"), float("inf"), float("-inf")):
            xs = _group_inputs("uniform", world, 2 * MiB, torch.bfloat16, 9)
            xs[world - 1][100] = bad  # the last rank's group 3: values 96..127
            xs[0][5000] = bad         # rank 0's group 156
            x = xs[rank].cuda()
            delay_random_rank(rank, world, rng)
            y = torch.ops._tpcomm.all_reduce(x, comm.comm_id, ALGO[mode])
            overwrite(x)
            nan = torch.isnan(y.cpu())
            expect = torch.zeros_like(nan)
            expect[96:128] = expect[4992:5024] = True
            assert torch.equal(nan, expect), (mode, bad, nan.nonzero()[:8].flatten().tolist())
            want = ref.emulate(xs, mode)
            assert_bits_equal(y.cpu()[~nan], want[~nan], f"{mode} with {bad}: the other groups")
            same_on_all_ranks(torch.nan_to_num(y, nan=0.0), f"{mode} with {bad}")
    comm.check()
    comm.close()


def body_graph_replays(rank, world):
    """Captured in a CUDA graph and replayed with new inputs (the epoch and
    bulk sequence come from the device), the routed quantized op gives the
    emulation's bits."""
    comm = tpcomm.Communicator(max_bytes=CAP, config=tpcomm.Config(quantize="int8"))
    numel = 2 * MiB // 2
    static = torch.zeros(numel, dtype=torch.bfloat16, device="cuda")
    comm.all_reduce(static)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    calls = Calls(comm)
    with comm.capture(), torch.cuda.graph(graph):
        out = comm.all_reduce(static)
    calls.expect("all_reduce", "quantized_int8")
    rng = shared_rng(29)
    for i in range(4):  # every data kind
        xs = _group_inputs(quantized_data.KINDS[i % 4], world, 2 * MiB, torch.bfloat16, 200 + i)
        static.copy_(xs[rank].cuda())
        delay_random_rank(rank, world, rng)
        graph.replay()
        overwrite(static)
        _check(out.clone(), xs, "int8", f"graph replay {i}")
    comm.check()
    comm.close()


def body_modes_that_differ_fail_naming_the_peer(rank, world):
    """Ranks that run different modes are told (the op's kind word differs:
    a mismatch), within the timeout: no hang, no silent result."""
    comm = tpcomm.Communicator(max_bytes=CAP, timeout_s=2.0)
    assert comm.enabled, comm.disabled_reason
    x = torch.ones(1 * MiB // 2, dtype=torch.bfloat16, device="cuda")
    torch.ops._tpcomm.all_reduce(x, comm.comm_id, ALGO["int8" if rank == 0 else "fp8"])
    torch.cuda.synchronize()  # returns: every wait is bounded
    with pytest.raises(tpcomm.CollectiveMismatch, match=r"peer \d"):
        comm.check()
    comm.close()


def body_fused_norm_stays_exact(rank, world):
    """With quantize on, all_reduce_add_rms_norm keeps its exact routes: the
    bits of a communicator without it; fp32 and small all-reduces too."""
    plain = tpcomm.Communicator(max_bytes=CAP)
    quant = tpcomm.Communicator(max_bytes=CAP, config=tpcomm.Config(quantize="int4"))
    g = torch.Generator(device="cuda").manual_seed(3 + rank)
    for rows in (4, 512):
        x = torch.randn(rows, 4096, generator=g, device="cuda").to(torch.bfloat16)
        res = torch.randn(rows, 4096, generator=g, device="cuda").to(torch.bfloat16)
        w = torch.randn(4096, generator=g, device="cuda").to(torch.bfloat16)
        a = plain.all_reduce_add_rms_norm(x, res, w)
        b = quant.all_reduce_add_rms_norm(x, res, w)
        for u, v in zip(a, b):
            assert_bits_equal(v, u, f"fused norm of {rows} rows")
    for x in (torch.randn(1 * MiB, generator=g, device="cuda"),  # fp32, 4 MiB
              torch.randn(1024, generator=g, device="cuda").to(torch.bfloat16)):  # under the minimum
        assert not quant.route_all_reduce(x).startswith("quantized")
        assert_bits_equal(quant.all_reduce(x), plain.all_reduce(x), f"{x.dtype} {x.nbytes} B")
    assert not any(b.startswith("quantized") for _, b in quant.stats())
    plain.close()
    quant.close()


@pytest.mark.parametrize("body", [body_within_bound_same_bits, body_in_place_back_to_back,
                                  body_nan_inf_poison_their_group, body_graph_replays,
                                  body_modes_that_differ_fail_naming_the_peer, body_fused_norm_stays_exact],
                         ids=lambda f: f.__name__[5:])
def test_quantized(body):
    multiproc.run_gpu(body, timeout=900)
