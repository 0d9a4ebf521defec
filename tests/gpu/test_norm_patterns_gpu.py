"""Every fusion pattern of tpcomm.norm_patterns on the fused kernel family
(csrc/kernels/all_reduce_norm.cuh) on real GPUs, through the private op
torch.ops._tpcomm.all_reduce_norm, against
tpcomm.reference.reference_all_reduce_norm: each pattern with weight w and
1 + w, in bfloat16 and float16, 1, 3 and 8 rows of 2048 and one row of
TPC_NORM_MAX_ROW_BYTES, out of place ("spread") and in place; a random rank
late before every op and the inputs overwritten right after it; the same
bits on every rank; every call on the "fused" route, counted once under its
pattern's key.

The ranks' inputs are integers in [-2, 2], so the sum s (at most 16 in
magnitude over 8 ranks) and its squares are exact and their row sum (at
most 256 x 16384 < 2^24) is the same in any order; a row of a power of two
values makes the mean exact as well. The scale of the norm of s is then the
reference's bits, so NORM_ADD's o = r + s * scale * w' (both outputs) and
NORM_ADD_NORM's stream output are held bit for bit, as is ADD_NORM's
z = s + r. A norm of z or o (ADD_NORM's and NORM_ADD_NORM's normed) sums
squares of values that are not integers, in the kernel's order rather than
torch's: within 1 ulp."""
import collections

import pytest
import torch
import torch.distributed as dist

import multiproc
import tpcomm
from gpu_checks import delay_random_rank, overwrite, shared_rng
from tpcomm import norm_patterns
from tpcomm.config import Config
from tpcomm.norm_patterns import STATS_KEY, Pattern
from tpcomm.reference import reference_all_reduce_norm, ulp_distance

pytestmark = pytest.mark.gpu

MiB = 1024 * 1024
EPS, NEXT_EPS = 1e-5, 1e-6
MAX_HIDDEN = tpcomm._lib.NORM_MAX_ROW_BYTES // 2  # 16-bit values in the kernel's longest row
SHAPES = [(1, 2048), (3, 2048), (8, 2048), (1, MAX_HIDDEN)]


def _comm():
    comm = tpcomm.Communicator(packet_max_bytes=1 * MiB, config=Config.from_env().replace(fused_kernel=True))
    assert comm.enabled, comm.disabled_reason
    return comm


def _gathered(x):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


def _shared(shape, dtype, seed):
    """Residual, weight and next weight, the same on every rank; weights in
    [-0.5, 0.5), so that 1 + w (Gemma's) is a plausible scale too."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    residual = torch.randn(shape, generator=g, device="cuda").to(dtype)
    weight, next_weight = ((torch.rand(shape[-1:], generator=g, device="cuda") - 0.5).to(dtype) for _ in range(2))
    return residual, weight, next_weight


def _same_on_every_rank(t, what):
    parts = _gathered(t)
    assert all(torch.equal(p.view(torch.int16), parts[0].view(torch.int16)) for p in parts), \
        f"differs across ranks: {what}"


def body_patterns(rank, world):
    comm = _comm()
    rng = shared_rng(11)
    expected = collections.Counter()
    seed = 0
    for pattern in Pattern:
        for offset in (0.0, 1.0):
            for dtype in (torch.bfloat16, torch.float16):
                for shape in SHAPES:
                    seed += 1
                    g = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)
                    x = torch.randint(-2, 3, shape, generator=g, device="cuda").to(dtype)
                    residual, weight, next_weight = _shared(shape, dtype, seed)
                    nw = next_weight if pattern == Pattern.NORM_ADD_NORM else None
                    what = f"{pattern.name} weight {'1 + w' if offset else 'w'} {dtype} {shape} at {world} ranks"
                    assert norm_patterns.route(comm, pattern, x, weight, nw, offset) == "fused", what
                    kept_x, kept_r = x.clone(), residual.clone()
                    delay_random_rank(rank, world, rng)
                    normed, stream = torch.ops._tpcomm.all_reduce_norm(x, residual, weight, nw, EPS, NEXT_EPS, offset,
                                                                       int(pattern), comm.group_name)
                    overwrite(x)
                    overwrite(residual)
                    expected[(STATS_KEY[pattern], "fused")] += 1
                    ref_normed, ref_stream = reference_all_reduce_norm(_gathered(kept_x), kept_r, weight, EPS,
                                                                       pattern, offset, nw, NEXT_EPS)
                    assert int(ulp_distance(stream, ref_stream).max()) == 0, f"stream {what}"
                    normed_ulps = 0 if pattern == Pattern.NORM_ADD else 1
                    assert int(ulp_distance(normed, ref_normed).max()) <= normed_ulps, f"normed {what}"
                    _same_on_every_rank(normed, f"normed {what}")
                    _same_on_every_rank(stream, f"stream {what}")
                    # in place: normed into the input, the stream output into the residual (no "spread")
                    xi, ri = kept_x.clone(), kept_r.clone()
                    delay_random_rank(rank, world, rng)
                    comm.kernels.all_reduce_norm(pattern, xi, ri, weight, nw, EPS, NEXT_EPS, offset, xi, ri)
                    assert torch.equal(xi.view(torch.int16), normed.view(torch.int16)), f"in place normed {what}"
                    assert torch.equal(ri.view(torch.int16), stream.view(torch.int16)), f"in place stream {what}"
    torch.cuda.synchronize()
    comm.check()
    assert {k: v["calls"] for k, v in comm.stats().items()} == dict(expected), comm.stats()
    comm.close()


def test_norm_patterns_on_the_fused_kernel():
    multiproc.run_gpu(body_patterns, timeout=300)
