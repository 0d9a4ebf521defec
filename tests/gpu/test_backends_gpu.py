"""The backend objects of tpcomm.backends (the ones the dispatcher and the
benchmark both run), one rank per GPU: every op of every backend bit for bit
against NCCL on integer-valued data (exact in any summation order), eager
(a random rank late before each op, the input overwritten right after) and
in a CUDA graph replayed with new inputs."""
import pytest
import torch
import torch.distributed as dist

import multiproc
import tpcomm
from tpcomm.backends.nccl import Nccl
from tpcomm.bench.nccl_window import NcclWindow
from tpcomm.bench.symm_mem import SymmMem
from gpu_checks import assert_bits_equal, delay_random_rank, int_valued, overwrite, shared_rng

pytestmark = pytest.mark.gpu

KiB = 1024


def _references(x, world):
    full = x.clone()
    dist.all_reduce(full)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return full, torch.cat(parts), full.view(world, -1)[dist.get_rank()].clone()


def body_backends(rank, world):
    group = dist.group.WORLD
    device = torch.device("cuda", rank)
    numels = (8 * world, 4 * KiB * world, 24 * KiB * world)  # every part a multiple of 16 bytes
    biggest = numels[-1] * 4
    comm = tpcomm.Communicator(max_bytes=16 << 20, packet_max_bytes=256 * KiB)
    assert comm.enabled and comm.kernels is not None, comm.disabled_reason
    nccl = Nccl(group)
    window = NcclWindow(group, device, biggest, world * biggest)
    window.allocate()
    window.register()
    symm = SymmMem(group, device, biggest)
    symm.allocate()
    symm.rendezvous()
    gen = torch.Generator(device="cuda").manual_seed(11 + rank)
    rng = shared_rng(13)

    def check(call, x, want, what):
        """call(a copy of x), a random rank late, the copy overwritten right after."""
        xi = x.clone()
        delay_random_rank(rank, world, rng)
        y = call(xi)
        y = y.clone() if y.data_ptr() == xi.data_ptr() else y
        overwrite(xi)
        assert_bits_equal(y, want, what)

    for numel in numels:
        for dtype in (torch.bfloat16, torch.float32):
            x = int_valued(numel, dtype, gen)
            ar, ag, rs = _references(x, world)
            what = f"{numel} x {dtype}"
            check(lambda y: nccl.all_reduce(y, out=y), x, ar, f"nccl all_reduce in place {what}")
            check(lambda y: nccl.all_gather(y, 0), x, ag, f"nccl all_gather {what}")
            check(nccl.reduce_scatter, x, rs, f"nccl reduce_scatter {what}")
            for algo in ("packet", "line", "bulk"):
                if algo != "bulk" and numel * x.element_size() > comm.packet_max_bytes:
                    continue
                check(lambda y: comm.kernels.all_reduce(y, algo), x, ar, f"{algo} all_reduce {what}")
                check(lambda y: comm.kernels.all_gather(y, 0, algo), x, ag, f"{algo} all_gather {what}")
                if algo != "line":  # no line reduce_scatter
                    check(lambda y: comm.kernels.reduce_scatter(y, algo), x, rs, f"{algo} reduce_scatter {what}")
            w = window.view("in", dtype, numel)
            w.copy_(x)
            assert_bits_equal(window.all_gather(w), ag, f"window all_gather {what}")
            assert_bits_equal(window.reduce_scatter(w), rs, f"window reduce_scatter {what}")
            assert_bits_equal(window.all_reduce(w), ar, f"window all_reduce {what}")
            for kind in ("one_shot", "two_shot"):
                s = symm.view(dtype, numel)
                s.copy_(x)
                assert_bits_equal(symm.all_reduce(s, kind).clone(), ar, f"symm {kind} {what}")

    # A graph of every backend, replayed with new inputs.
    x = torch.zeros(4 * KiB * world, dtype=torch.bfloat16, device=device)
    w = window.view("in", x.dtype, x.numel())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        w.copy_(x)
        outs = [comm.kernels.all_reduce(x, "packet"), comm.kernels.all_gather(x, 0, "bulk"),
                window.all_gather(w).clone(), nccl.reduce_scatter(x)]
    for step in range(3):
        x.copy_(int_valued(x.numel(), x.dtype, gen))
        graph.replay()
        ar, ag, rs = _references(x, world)
        for got, want, name in zip(outs, (ar, ag, ag, rs), ("packet all_reduce", "bulk all_gather",
                                                            "window all_gather", "nccl reduce_scatter")):
            assert_bits_equal(got, want, f"graph replay {step}: {name}")
    torch.cuda.synchronize()
    window.close()
    comm.close()


def test_backend_objects():
    if multiproc.gpus_shared():
        pytest.skip("NCCL's window and SymmetricMemory need NCCL, one GPU per rank (ranks share GPUs here)")
    multiproc.run_gpu(body_backends, timeout=240)
