"""all_gather on real GPUs: bit for bit against the NCCL path and against
torch.cat of every rank's input (each rank can rebuild all inputs from their
seeds), for every dtype, special values, dims and size bands, at any world
size from 2 to 8. Every op runs with a random rank late and its input
overwritten right after it; every Communicator call is checked against
stats() for the backend its route names, and the internal op
(torch.ops._tpcomm.all_gather, algo explicit) runs the kernel it is told."""
import pytest
import torch

import multiproc
import tpcomm
from gpu_checks import (ALGO, KERNELS, Calls, KiB, MiB, assert_custom_only, delay_random_rank, overwrite, round16,
                        shared_rng, stats_label)

pytestmark = pytest.mark.gpu



def _as_bytes(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.contiguous().view(torch.uint8)


def _assert_same_bits(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    assert a.is_contiguous(), f"{what}: output not contiguous"
    if not torch.equal(_as_bytes(a), _as_bytes(b)):
        bad = (_as_bytes(a) != _as_bytes(b)).nonzero()
        raise AssertionError(f"{what}: {bad.numel()} bytes differ, first at {bad[:4].flatten().tolist()}")


def _special_values(n, dtype, gen):
    """Random bits for any dtype, then -0.0, NaN with payloads, +-inf and
    subnormals written in for floating types."""
    nbytes = n * (dtype.itemsize if dtype != torch.bool else 1)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen, device="cuda")
    if dtype == torch.bool:
        return (raw & 1).bool()
    t = raw.view(dtype).clone()
    if dtype.is_floating_point and n >= 8:
        specials = {
            torch.float32: [0x80000000, 0x7FC00123, 0xFFA00001, 0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF],
            torch.float16: [0x8000, 0x7E01, 0xFC00, 0x7C00, 0x0001, 0x83FF, 0xFD55],
            torch.bfloat16: [0x8000, 0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x0001, 0x807F],
        }.get(dtype)
        if specials is not None:
            ints = {4: torch.int32, 2: torch.int16}[dtype.itemsize]
            vals = torch.tensor([v - (1 << 8 * dtype.itemsize) if v >= 1 << (8 * dtype.itemsize - 1) else v
                                 for v in specials], dtype=ints, device="cuda")
            t.view(ints)[: len(specials)] = vals
    return t


def _inputs_of_all_ranks(shape, dtype, seed, world):
    out = []
    for r in range(world):
        gen = torch.Generator(device="cuda").manual_seed(seed * 131 + r)
        numel = 1
        for s in shape:
            numel *= s
        out.append(_special_values(numel, dtype, gen).view(shape))
    return out


def _nccl_path(comm, x, dim):
    """What the NCCL fallback returns (all_gather_into_tensor, then moved)."""
    if x.dtype == torch.bool or x.dtype.itemsize == 1:
        return comm._nccl.all_gather(x.view(torch.uint8), dim).view(x.dtype)
    return comm._nccl.all_gather(x, dim)


CASES = (
    [((n, 1024), torch.bfloat16) for n in range(1, 49)]
    + [((1, 32768), torch.bfloat16), ((1, 16), torch.float32), ((8, 16), torch.float32), ((8, 2), torch.float32),
       ((37, 64), torch.int32), ((16, 48), torch.int8), ((24, 40), torch.bool), ((40, 24), torch.float8_e4m3fn),
       ((3, 5, 8), torch.float16), ((7, 4), torch.int64), ((4, 6), torch.uint8)]
)


def _check(comm, shape, dtype, dim, seed, world, rank, what, rng, algo=None, calls=None):
    """One all_gather, routed (algo None; counted on its route in `calls`)
    or on the kernel `algo` names, a random rank late, the input overwritten
    right after; returns the route."""
    xs = _inputs_of_all_ranks(shape, dtype, seed, world)
    x = xs[rank].clone()
    route = comm.route_all_gather(x, dim) if algo is None else algo
    delay_random_rank(rank, world, rng)
    if algo is None:
        y = comm.all_gather(x, dim)
    else:
        y = torch.ops._tpcomm.all_gather(x, dim, comm.comm_id, ALGO[algo])
    overwrite(x)
    if calls is not None and algo is None:
        calls.expect("all_gather", route)
    _assert_same_bits(y, torch.cat(xs, dim), f"{what} ({route}) vs torch.cat")
    _assert_same_bits(y, _nccl_path(comm, xs[rank], dim), f"{what} ({route}) vs NCCL path")
    return route


def body_shapes_dtypes_dims(rank, world):
    comm = tpcomm.Communicator()
    assert comm.enabled, comm.disabled_reason
    calls, rng = Calls(comm), shared_rng(51)
    seed = 0
    routes = set()
    for shape, dtype in CASES:
        for dim in (0, 1, -1):
            seed += 1
            routes.add(_check(comm, shape, dtype, dim, seed, world, rank, f"{shape} {dtype} dim {dim}", rng,
                              calls=calls))
    assert "packet" in routes, routes
    # transposed (non-contiguous) input
    xs = _inputs_of_all_ranks((64, 48), torch.bfloat16, 999, world)
    for dim in (0, 1):
        x = xs[rank].t()
        route = comm.route_all_gather(x, dim)
        y = comm.all_gather(x, dim)
        calls.expect("all_gather", route)
        _assert_same_bits(y, torch.cat([t.t() for t in xs], dim), f"transposed dim {dim}")
    comm.check()
    comm.close()


def body_size_bands(rank, world):
    """Sizes just below and above the packet cap and the cap on the output
    at this world size, routed and on each kernel forced; small sizes the
    bulk kernel cannot take; every size a kernel takes at any world size."""
    max_bytes = 4 * MiB
    comm = tpcomm.Communicator(max_bytes=max_bytes, packet_max_bytes=1 * MiB)
    assert comm.enabled, comm.disabled_reason
    calls, rng = Calls(comm), shared_rng(53)
    per_rank_cap = round16(max_bytes // world)  # the most a rank may give for the output to fit the cap
    seen = {}
    for nbytes in sorted({64 * KiB - 16, 64 * KiB, 64 * KiB + 16, 1 * MiB - 16, 1 * MiB, 1 * MiB + 16,
                          per_rank_cap - 16, per_rank_cap, per_rank_cap + 16, 4, 12, 20}):
        shape = (nbytes // 4,)
        seen[nbytes] = _check(comm, shape, torch.float32, 0, nbytes, world, rank, f"{nbytes} B per rank", rng,
                              calls=calls)
        for algo in ("packet", "line", "bulk"):
            cap = per_rank_cap if algo == "bulk" else comm.packet_max_bytes
            if nbytes % 16 or nbytes > cap:
                continue
            _check(comm, shape, torch.float32, 0, nbytes + 7, world, rank, f"{nbytes} B forced {algo}", rng, algo)
    # within the packet cap: a kernel, whatever the table; past both caps: NCCL
    assert all(seen[n] in KERNELS for n in seen if n <= 64 * KiB), seen
    assert seen[max(1 * MiB, per_rank_cap) + 16] == stats_label(comm, "nccl"), seen  # the fallback, as routes name it
    with pytest.raises(RuntimeError, match="is over max_bytes"):
        torch.ops._tpcomm.all_gather(torch.zeros(per_rank_cap // 4 + 4, device="cuda"), 0, comm.comm_id, ALGO["bulk"])
    comm.check()
    comm.close()


def body_graph_replays(rank, world):
    comm = tpcomm.Communicator()
    assert comm.enabled, comm.disabled_reason
    rng = shared_rng(57)
    shapes = [((8, 1024), torch.bfloat16, 1), ((1, 32768), torch.bfloat16, 0), ((512, 1024), torch.bfloat16, -1),
              ((4096 // world, 1024), torch.float16, 0), ((8, 2), torch.float32, 1), ((24, 40), torch.bool, 0)]
    static = [torch.zeros(s, dtype=d, device="cuda") for s, d, _ in shapes]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture():
        with torch.cuda.graph(graph):
            outs = []
            for x, (_, _, dim) in zip(static, shapes):
                delay_random_rank(rank, world, rng)
                outs.append(comm.all_gather(x, dim))
    assert_custom_only(comm, want=("packet",))
    for replay in range(25):
        refs = []
        for i, (x, (shape, dtype, dim)) in enumerate(zip(static, shapes)):
            xs = _inputs_of_all_ranks(shape, dtype, 1000 * replay + i, world)
            x.copy_(xs[rank])
            refs.append(torch.cat(xs, dim))
        graph.replay()
        for x in static:
            overwrite(x)  # right after the replay, on the stream
        for i, (y, ref) in enumerate(zip(outs, refs)):
            _assert_same_bits(y, ref, f"replay {replay} case {i}")
        if replay % 5 == 0:
            _check(comm, (4, 256), torch.bfloat16, 0, replay, world, rank, f"eager after replay {replay}", rng)
    comm.check()
    assert_custom_only(comm, want=("packet",))
    comm.close()


def body_size_mismatch(rank, world):
    """Ranks that give different sizes to the kernels: an error, not a result."""
    comm = tpcomm.Communicator(timeout_s=2.0)
    assert comm.enabled, comm.disabled_reason
    x = torch.ones(256 if rank == 0 else 512, dtype=torch.int32, device="cuda")
    assert comm.route_all_gather(x, 0) in KERNELS
    comm.all_gather(x)
    torch.cuda.synchronize()
    with pytest.raises(tpcomm.TpcommError, match="different op"):
        comm.check()
    comm.close()


SEED_CAP = 64 * KiB  # vLLM's CudaCommunicator sends gathers up to this to custom_all_gather
SEED_CASES = ([((n, 1024), torch.bfloat16) for n in range(1, 49)]  # 33..48 rows: above the cap
              + [((1, 32768), torch.bfloat16), ((1, 16), torch.float32), ((8, 16), torch.float32),
                 ((8, 2), torch.float32)])


def _seed_all_gather(comm, x, dim):
    """vLLM's CudaCommunicator.all_gather, literally: tpcomm's kernel
    (custom_all_gather) up to the cap, torch.distributed when it declines."""
    if x.nbytes <= SEED_CAP:
        y = comm.custom_all_gather(x, dim)
        if y is not None:
            return y
    # vLLM's GroupCoordinator fallback: all_gather_into_tensor along dim 0, then moved to dim
    dim, size, world = dim % x.dim(), x.shape, comm.world_size
    out = torch.empty((world * size[0],) + tuple(size[1:]), dtype=x.dtype, device=x.device)
    torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=comm.group)
    out = out.reshape((world,) + tuple(size)).movedim(0, dim)
    return out.reshape(tuple(size[:dim]) + (world * size[dim],) + tuple(size[dim + 1:]))


def body_seed_routing(rank, world):
    """The seed routing over custom_all_gather's decline contract: eager over
    every case and dim (NaN payloads, ±inf, subnormals and ±0 in every
    input), then 20 replays of a CUDA graph of it; stats() counts a kernel
    call exactly where the routing says the kernel takes it."""
    comm = tpcomm.Communicator()
    assert comm.enabled, comm.disabled_reason
    calls, rng = Calls(comm), shared_rng(61)
    took = {}
    for i, (shape, dtype) in enumerate(SEED_CASES):
        for dim in (0, 1, -1):
            xs = _inputs_of_all_ranks(shape, dtype, 7000 + 3 * i + dim, world)
            x = xs[rank].clone()
            route = comm.route_all_gather(x, dim)
            kernel = x.nbytes <= SEED_CAP and route in KERNELS
            delay_random_rank(rank, world, rng)
            y = _seed_all_gather(comm, x, dim)
            overwrite(x)
            calls.expect("all_gather", route, calls=1 if kernel else 0)
            assert calls.ran("all_gather", "nccl") == 0, comm.stats()  # the contract never falls back
            _assert_same_bits(y, torch.cat(xs, dim), f"seed all_gather {shape} {dtype} dim {dim} ({route})")
            took[(shape, dim)] = kernel
    assert all(took[(s, 0)] for s, d in SEED_CASES if s[0] * s[1] * d.itemsize <= SEED_CAP), took
    assert not any(took[((48, 1024), dim)] for dim in (0, 1, -1)), "48 x 1024 bf16 is above the cap"

    graph_cases = [((1, 1024), torch.bfloat16, 0), ((8, 1024), torch.bfloat16, -1), ((1, 32768), torch.bfloat16, 1),
                   ((8, 2), torch.float32, 1), ((1, 16), torch.float32, 0)]
    if stats_label(comm, "nccl") == "nccl":  # a case above the cap: NCCL is captured; gloo (ranks sharing a GPU) is not
        graph_cases.append(((48, 1024), torch.bfloat16, 0))
    static = [torch.zeros(s, dtype=d, device="cuda") for s, d, _ in graph_cases]
    for x, (_, _, dim) in zip(static, graph_cases):
        _seed_all_gather(comm, x, dim)  # warm up (NCCL's communicator exists before capture)
    torch.cuda.synchronize()
    before = comm.stats()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        outs = [_seed_all_gather(comm, x, dim) for x, (_, _, dim) in zip(static, graph_cases)]
    captured = {k: v["calls"] - before.get(k, {"calls": 0})["calls"] for k, v in comm.stats().items()}
    want = sum(x.nbytes <= SEED_CAP and comm.route_all_gather(x, dim) in KERNELS
               for x, (_, _, dim) in zip(static, graph_cases))
    above_cap = sum(s[0] * s[1] * d.itemsize > SEED_CAP for s, d, _ in graph_cases)
    assert len(graph_cases) - above_cap - 1 <= want <= len(graph_cases) - above_cap, want
    assert sum(n for (op, b), n in captured.items() if b in KERNELS) == want, captured
    for replay in range(20):
        refs = []
        for i, (x, (shape, dtype, dim)) in enumerate(zip(static, graph_cases)):
            xs = _inputs_of_all_ranks(shape, dtype, 9000 + 10 * replay + i, world)
            x.copy_(xs[rank])
            refs.append(torch.cat(xs, dim))
        delay_random_rank(rank, world, rng)
        graph.replay()
        for x in static:
            overwrite(x)
        for i, (y, ref) in enumerate(zip(outs, refs)):
            _assert_same_bits(y, ref, f"seed routing replay {replay} case {graph_cases[i][:1]}")
    comm.check()
    comm.close()


@pytest.mark.parametrize("body", [body_shapes_dtypes_dims, body_size_bands, body_graph_replays, body_size_mismatch,
                                  body_seed_routing],
                         ids=lambda f: f.__name__[5:])
def test_all_gather(body):
    multiproc.run_gpu(body)
