"""all_reduce_add_rms_norm on real GPUs against the fp32 reference
(tpcomm.reference: the sum in rank order, the residual added, RMSNorm,
rounded once): on the fused kernel and on the split route (reduce-scatter
in fp32, the norm on a rank's rows, all-gather) residual_out bit for bit and
normed within 1 ulp (its mean of squares is summed in another order),
identical bits on every rank, in place and out of place, graph replays with
new inputs, a random rank late before every op and inputs overwritten right
after, NaN and inf where the reference has them, and the unfused path for
what neither takes, with shapes built from the world size so that every
route runs at any world size from 2 to 8. Every body checks the routes it
expects through stats()."""
import collections
import random

import pytest
import torch
import torch.distributed as dist

import multiproc
import tpcomm
from tpcomm import routing
from gpu_checks import delay_random_rank, overwrite, shared_rng
from tpcomm.config import Config
from tpcomm.reference import reference_add_rms_norm, ulp_distance

pytestmark = pytest.mark.gpu

KiB, MiB = 1024, 1024 * 1024
EPS = 1e-5


def _comm():
    comm = tpcomm.Communicator(packet_max_bytes=1 * MiB, config=Config.from_env().replace(fused_kernel=True))
    assert comm.enabled, comm.disabled_reason
    return comm


def _takes_fused(comm, tokens, hidden):
    """Whether routing should give (tokens, hidden) of a 16-bit dtype the fused kernel: within the
    packet cap, from 5 ranks on the fused kernel's own (the table's, or the cost model's), and the
    kernel's row limit."""
    return (tokens * hidden * 2 <= min(1 * MiB, routing.fused_norm_max(comm._routes))
            and hidden * 2 <= tpcomm._lib.NORM_MAX_ROW_BYTES)


def _shared(shape, dtype, seed):
    """Residual and weight, the same on every rank (tensor parallelism)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    residual = torch.randn(shape, generator=g, device="cuda").to(dtype)
    weight = (torch.rand(shape[-1:], generator=g, device="cuda") + 0.5).to(dtype)
    return residual, weight


def _gathered(x):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


def _check(normed, summed, x, residual, weight, what):
    ref_normed, ref_summed = reference_add_rms_norm(_gathered(x), residual, weight, EPS)
    assert int(ulp_distance(summed, ref_summed).max()) == 0, f"residual_out {what}"
    assert int(ulp_distance(normed, ref_normed).max()) <= 1, f"normed {what}"
    for t, name in ((normed, "normed"), (summed, "residual_out")):
        parts = _gathered(t)
        assert all(torch.equal(p.view(torch.int16), parts[0].view(torch.int16)) for p in parts), \
            f"{name} differs across ranks: {what}"


def body_shapes(rank, world):
    comm = _comm()
    rng = random.Random(5)
    skew = shared_rng(6)
    shapes = [(1, 4096), (1, 8192), (8, 4096), (32, 4096), (3, 2048), (1, 16384), (2, 5120), (64, 8192),
              (17, 2048), (128, 4096)]
    shapes += [(rng.randrange(1, 33), rng.choice([2048, 3072, 4096, 6144, 8192])) for _ in range(6)]
    # over the packet cap: the split route where the rows divide among the ranks (the first two at any
    # world size), else the unfused one
    shapes += [(128 * world, 4096), (40 * world, 8192), (1024, 2048), (515, 4096), (2, 32768)]
    gen = torch.Generator(device="cuda").manual_seed(40 + rank)
    expected = collections.Counter()
    for i, (tokens, hidden) in enumerate(shapes):
        for dtype in (torch.bfloat16, torch.float16):
            x = (torch.randn(tokens, hidden, generator=gen, device="cuda") * (1 + rank)).to(dtype)
            residual, weight = _shared((tokens, hidden), dtype, 1000 + i)
            route = comm.route_all_reduce_add_rms_norm(x, weight)
            split = tokens % world == 0 and tokens * hidden * 2 <= comm.max_bytes
            assert route == ("fused" if _takes_fused(comm, tokens, hidden) else "split" if split else "unfused"), \
                (tokens, hidden, route)
            expected[route] += 2
            what = f"{tokens}x{hidden} {dtype} ({route})"
            kept_x, kept_r = x.clone(), residual.clone()
            delay_random_rank(rank, world, skew)
            normed, summed = comm.all_reduce_add_rms_norm(x, residual, weight, EPS)
            overwrite(x)
            overwrite(residual)
            _check(normed, summed, kept_x, kept_r, weight, what)
            xi, ri = kept_x.clone(), kept_r.clone()
            delay_random_rank(rank, world, skew)
            comm.all_reduce_add_rms_norm(xi, ri, weight, EPS, in_place=True)
            assert torch.equal(xi.view(torch.int16), normed.view(torch.int16)), f"in place normed {what}"
            assert torch.equal(ri.view(torch.int16), summed.view(torch.int16)), f"in place residual {what}"
    # tokens 4096 of hidden 4096: over the packet cap, the unfused path
    x = torch.randn(4096, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    residual, weight = _shared((4096, 4096), torch.bfloat16, 7)
    assert comm.route_all_reduce_add_rms_norm(x, weight) == "unfused"
    expected["unfused"] += 1
    normed, summed = comm.all_reduce_add_rms_norm(x, residual, weight, EPS)
    ref_normed, ref_summed = reference_add_rms_norm(_gathered(x), residual, weight, EPS)
    assert int(ulp_distance(summed, ref_summed).max()) <= 1 and int(ulp_distance(normed, ref_normed).max()) <= 1
    stats = {b: s["calls"] for (op, b), s in comm.stats().items() if op == "all_reduce_add_rms_norm"}
    assert stats == dict(expected), (stats, expected)
    assert expected["fused"] > 20 and expected["split"] >= 4, expected
    comm.close()


def body_nan_inf(rank, world):
    comm = _comm()
    x = torch.ones(4, 4096, device="cuda", dtype=torch.bfloat16)
    residual, weight = _shared((4, 4096), torch.bfloat16, 3)
    if rank == world - 1:
        x[1, 7] = float("nan")
        x[2, 9] = float("inf")
    kept = x.clone()
    assert comm.route_all_reduce_add_rms_norm(x, weight) == "fused"
    delay_random_rank(rank, world, shared_rng(4))
    normed, summed = comm.all_reduce_add_rms_norm(x, residual, weight, EPS)
    overwrite(x)
    assert comm.stats()[("all_reduce_add_rms_norm", "fused")]["calls"] == 1, comm.stats()
    ref_normed, ref_summed = reference_add_rms_norm(_gathered(kept), residual, weight, EPS)
    for got, ref, name in ((normed, ref_normed, "normed"), (summed, ref_summed, "residual_out")):
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"NaN positions of {name}"
        assert torch.equal(torch.isinf(got), torch.isinf(ref)), f"inf positions of {name}"
    assert torch.isnan(normed[1]).all()  # the row's mean of squares is NaN
    assert torch.isnan(normed[2, 9]) and (normed[2, :9] == 0).all()  # inf: the scale is 0, inf * 0 NaN
    assert not torch.isnan(normed[0]).any() and not torch.isnan(normed[3]).any()
    comm.close()


def body_graph_and_skew(rank, world):
    comm = _comm()
    gen = torch.Generator(device="cuda").manual_seed(80 + rank)
    rng = shared_rng(9)
    shapes = [(1, 4096), (8, 4096), (32, 8192), (64 * world, 8192)]  # the last over the packet cap: split
    static_x = [torch.zeros(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    static_res = [torch.zeros(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    weights = [_shared(s, torch.bfloat16, 50 + i)[1] for i, s in enumerate(shapes)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        outs = []
        for x, r, w in zip(static_x, static_res, weights):
            delay_random_rank(rank, world, rng)
            outs.append(comm.all_reduce_add_rms_norm(x, r, w, EPS))
    for replay in range(20):
        kept = []
        for i, (x, r) in enumerate(zip(static_x, static_res)):
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda").to(x.dtype))
            r.copy_(_shared(x.shape, x.dtype, 100 * replay + i)[0])
            kept.append((x.clone(), r.clone()))
        graph.replay()
        for x, r in zip(static_x, static_res):  # overwritten right after the replay
            overwrite(x)
            overwrite(r)
        for i, ((x, r), w, (normed, summed)) in enumerate(zip(kept, weights, outs)):
            _check(normed, summed, x, r, w, f"replay {replay} op {i}")
    comm.check()
    # captured once each; the last is over the packet cap, and from 5 ranks on (32, 8192) is over the
    # fused kernel's own cap (the table's, or the cost model's): both split
    routes = collections.Counter(comm.route_all_reduce_add_rms_norm(x, w) for x, w in zip(static_x, weights))
    fused = sum(_takes_fused(comm, *shape) for shape in shapes)
    assert routes == {"fused": fused, "split": len(shapes) - fused}, routes
    stats = comm.stats()
    assert {how: stats[("all_reduce_add_rms_norm", how)]["calls"] for how in routes} == routes, stats
    comm.close()


@pytest.mark.parametrize("body", [body_shapes, body_nan_inf, body_graph_and_skew],
                         ids=lambda f: f.__name__[5:])
def test_all_reduce_add_rms_norm(body):
    multiproc.run_gpu(body, timeout=300)
