"""reduce_scatter on real GPUs, bit for bit against NCCL's
reduce_scatter_tensor on integer-valued data (exact in any summation order):
packet and bulk, every reducible dtype, sizes around the caps, dims 0 and 1,
graph replays with new inputs, bulk ops queued back to back, a random rank
late before every op, inputs overwritten right after, a view misaligned on
one rank. Sizes are built from
the world size (each rank's part a multiple of 16 bytes, what the kernels
need), so every body runs at any world size from 2 to 8. Every Communicator
call is checked against stats() for the backend its route names."""
import pytest
import torch

import multiproc
import tpcomm
from gpu_checks import (ALGO, DTYPES, KERNELS, Calls, KiB, MiB, all_reduce_algo, assert_bits_equal,
                        assert_custom_only, chunk_numel, delay_random_rank, int_valued, nccl_all_reduce,
                        nccl_reduce_scatter, overwrite, round16, shared_rng, takes)

pytestmark = pytest.mark.gpu

CAP = 16 * MiB


def _part_sizes(world):
    """Bytes of one rank's part: tiny, around the packet cap, and the most
    the cap allows at this world size."""
    return (16, 48, 4 * KiB, 64 * KiB - 16, 1 * MiB, 1 * MiB + 16, round16(CAP // world))


def body_sizes_dtypes_algos(rank, world):
    comm = tpcomm.Communicator(max_bytes=CAP, packet_max_bytes=1 * MiB)
    assert comm.enabled, comm.disabled_reason
    calls = Calls(comm)
    gen = torch.Generator(device="cuda").manual_seed(60 + rank)
    rng = shared_rng(61)
    for part in _part_sizes(world):
        for dtype in DTYPES:
            x = int_valued(chunk_numel(world, dtype, part), dtype, gen)
            ref = nccl_reduce_scatter(x)
            route = comm.route_reduce_scatter(x)
            assert part > 64 * KiB or route in KERNELS, (part, route)  # small parts: a kernel
            xi = x.clone()
            delay_random_rank(rank, world, rng)
            y = comm.reduce_scatter(xi)
            overwrite(xi)
            calls.expect("reduce_scatter", route)
            assert_bits_equal(y, ref, f"routed ({route}) {part} B per part {dtype}")
            for algo in ("packet", "line", "bulk"):
                if not takes(comm, "reduce_scatter", algo, x):
                    continue
                xi = x.clone()
                delay_random_rank(rank, world, rng)
                y = torch.ops._tpcomm.reduce_scatter(xi, comm.comm_id, ALGO[algo])
                overwrite(xi)
                assert_bits_equal(y, ref, f"{algo} {part} B per part {dtype}")
    x = int_valued(8 * 256 * world, torch.bfloat16, gen).view(8, 256 * world)
    kept = x.clone()
    route = comm.route_reduce_scatter(x)
    y = comm.reduce_scatter(x, dim=1)
    overwrite(x)
    calls.expect("reduce_scatter", route)
    assert_bits_equal(y, nccl_reduce_scatter(kept, 1), "dim 1")
    base = torch.empty(4096 * world + 8, dtype=torch.float32, device="cuda")
    data = int_valued(4096 * world, torch.float32, gen)
    view = base[1:1 + 4096 * world] if rank == 0 else base[:4096 * world]
    view.copy_(data)
    route = comm.route_reduce_scatter(view)
    assert route in KERNELS, route
    y = comm.reduce_scatter(view)
    overwrite(base)
    calls.expect("reduce_scatter", route)
    assert_bits_equal(y, nccl_reduce_scatter(data), "misaligned on rank 0")
    with pytest.raises(RuntimeError, match="multiple of 16"):  # parts of 8 bytes: no kernel takes them
        torch.ops._tpcomm.reduce_scatter(int_valued(4 * world, torch.float16, gen), comm.comm_id, ALGO["packet"])
    comm.check()
    comm.close()


def body_graph_and_skew(rank, world):
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(70 + rank)
    rng = shared_rng(8)
    # bf16 parts of 1 KiB and 64 KiB (packet), and of 6 MiB / world (bulk at any world size)
    sizes = [chunk_numel(world, torch.bfloat16, p) for p in (1 * KiB, 64 * KiB, round16(6 * MiB // world))]
    static_in = [torch.zeros(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        outs = []
        for x in static_in:
            delay_random_rank(rank, world, rng)
            outs.append(comm.reduce_scatter(x))
    assert_custom_only(comm, want=())
    for replay in range(30):
        kept = []
        for x in static_in:
            x.copy_(int_valued(x.numel(), x.dtype, gen))
            kept.append(x.clone())
        graph.replay()
        for x in static_in:
            overwrite(x)  # right after the replay, on the stream
        for i, (k, y) in enumerate(zip(kept, outs)):
            assert_bits_equal(y, nccl_reduce_scatter(k), f"replay {replay} op {i}")
        if replay % 5 == 0:
            e = int_valued(256 * world, torch.float16, gen)
            kept_e = e.clone()
            delay_random_rank(rank, world, rng)
            y = comm.reduce_scatter(e)
            overwrite(e)
            assert_bits_equal(y, nccl_reduce_scatter(kept_e), f"eager between replays {replay}")
    comm.check()
    assert_custom_only(comm, want=())
    assert sum(s["calls"] for s in comm.stats().values()) == len(sizes) + 6
    comm.close()


def body_bulk_back_to_back(rank, world):
    """The bulk kernel queued back to back without waiting, into both output
    dtypes: consecutive ops take the two halves of the bulk region in turn,
    and a cap-sized bulk all_reduce between them takes the whole region from
    three ranks on (all_reduce.cuh), so the reduce_scatter after it waits for
    its release. Parts from one 16-byte unit to the cap, of one block step
    and of several, a random rank late before each op, inputs overwritten
    right after each."""
    comm = tpcomm.Communicator(max_bytes=CAP)
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(80 + rank)
    rng = shared_rng(81)
    ops = torch.ops._tpcomm
    done = []  # (what, the input as it was, the output, its NCCL reference)
    cap_part = round16(CAP // world)
    parts = [cap_part, 16, 1 * MiB + 16, cap_part - 16, 64 * KiB, round16(cap_part // 2) + 16]
    for i, part in enumerate(parts * 2):
        for f32 in (False, True):
            dtype = DTYPES[(2 * i + f32) % len(DTYPES)]
            x = int_valued(chunk_numel(world, dtype, part), dtype, gen)
            kept = x.clone()
            delay_random_rank(rank, world, rng)
            y = (ops.reduce_scatter_f32 if f32 else ops.reduce_scatter)(x, comm.comm_id, ALGO["bulk"])
            overwrite(x)
            done.append((f"op {i}: {part} B per part {dtype}, out {y.dtype}", kept, y, nccl_reduce_scatter))
        if i % 3 == 2:
            x = int_valued(CAP // 2, torch.bfloat16, gen)
            kept = x.clone()
            delay_random_rank(rank, world, rng)
            y = ops.all_reduce(x, comm.comm_id, all_reduce_algo(comm, "bulk"))
            overwrite(x)
            done.append((f"all_reduce after op {i}", kept, y, nccl_all_reduce))
    for what, kept, y, reference in done:
        assert_bits_equal(y, reference(kept).to(y.dtype), what)  # fp32 sums of integers: exact
    comm.check()
    comm.close()


@pytest.mark.parametrize("body", [body_sizes_dtypes_algos, body_graph_and_skew, body_bulk_back_to_back],
                         ids=lambda f: f.__name__[5:])
def test_reduce_scatter(body):
    multiproc.run_gpu(body, timeout=300)
