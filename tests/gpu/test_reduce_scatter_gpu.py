"""custom_reduce_scatter on real GPUs, bit for bit against NCCL's
reduce_scatter_tensor on integer-valued data (exact in any summation order):
packet and bulk, every reducible dtype, sizes around the caps, dims 0 and 1,
graph replays with new inputs, a random rank late, a view misaligned on one
rank. Every body checks stats() for the custom path."""
import random

import pytest
import torch
import torch.distributed as dist

import multiproc
import tpcomm
from gpu_checks import assert_bits_equal as _assert_bits_equal, int_valued as _int_valued

pytestmark = pytest.mark.gpu

KiB, MiB = 1024, 1024 * 1024
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _nccl_rs(x, dim=0):
    world = dist.get_world_size()
    parts = x.movedim(dim, 0).contiguous()
    out = torch.empty((parts.shape[0] // world,) + tuple(parts.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, parts)
    return out.movedim(0, dim).contiguous()


def _assert_custom(comm):
    stats = comm.stats()
    assert comm.enabled and not any(b == "nccl" for _, b in stats), stats


def body_sizes_dtypes_algos(rank, world):
    comm = tpcomm.Communicator(max_bytes=16 * MiB, packet_max_bytes=1 * MiB)
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(60 + rank)
    for chunk in (16, 48, 4 * KiB, 64 * KiB - 16, 1 * MiB, 1 * MiB + 16, 16 * MiB // world):
        for dtype in DTYPES:
            n = chunk * world // dtype.itemsize
            x = _int_valued(n, dtype, gen)
            ref = _nccl_rs(x)
            _assert_bits_equal(comm.reduce_scatter(x), ref, f"auto {chunk} B per part {dtype}")
            for algo in (tpcomm._lib.ALGO_PACKET, tpcomm._lib.ALGO_BULK):
                if algo == tpcomm._lib.ALGO_PACKET and chunk > comm.packet_max_bytes:
                    continue
                y = torch.ops.tpcomm.custom_reduce_scatter(x, comm.handle, algo)
                _assert_bits_equal(y, ref, f"algo {algo} {chunk} B per part {dtype}")
    x = _int_valued(8 * 256 * world, torch.bfloat16, gen).view(8, 256 * world)
    _assert_bits_equal(comm.reduce_scatter(x, dim=1), _nccl_rs(x, 1), "dim 1")
    base = torch.empty(4096 * world + 8, dtype=torch.float32, device="cuda")
    data = _int_valued(4096 * world, torch.float32, gen)
    view = base[1:1 + 4096 * world] if rank == 0 else base[:4096 * world]
    view.copy_(data)
    _assert_bits_equal(comm.reduce_scatter(view), _nccl_rs(data), "misaligned on rank 0")
    _assert_custom(comm)
    comm.close()


def body_graph_and_skew(rank, world):
    comm = tpcomm.Communicator()
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(70 + rank)
    rng = random.Random(8)
    # bf16 elements: packet, packet, and bulk on 2 ranks (6 MiB in: within the cap at any world size)
    sizes = [512 * world, 32 * KiB * world, 3 * MiB]
    static_in = [torch.zeros(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
    delays = [(rng.randrange(world), rng.uniform(0, 60)) for _ in sizes]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        outs = []
        for x, (who, us) in zip(static_in, delays):
            if who == rank:
                torch.cuda._sleep(int(us * 1980))
            outs.append(comm.reduce_scatter(x))
    for replay in range(30):
        kept = []
        for x in static_in:
            x.copy_(_int_valued(x.numel(), x.dtype, gen))
            kept.append(x.clone())
        graph.replay()
        for x in static_in:
            x.fill_(float("nan"))  # overwritten right after the replay
        for i, (k, y) in enumerate(zip(kept, outs)):
            _assert_bits_equal(y, _nccl_rs(k), f"replay {replay} op {i}")
        if replay % 5 == 0:
            e = _int_valued(256 * world, torch.float16, gen)
            _assert_bits_equal(comm.reduce_scatter(e), _nccl_rs(e), f"eager between replays {replay}")
    comm.check()
    _assert_custom(comm)
    comm.close()


@pytest.mark.parametrize("body", [body_sizes_dtypes_algos, body_graph_and_skew], ids=lambda f: f.__name__[5:])
def test_reduce_scatter(body):
    multiproc.run_gpu(body, timeout=300)
