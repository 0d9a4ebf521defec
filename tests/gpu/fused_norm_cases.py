"""What the GPU tests of the fused kernel family share
(tests/gpu/test_norm_patterns_gpu.py, tests/gpu/test_fp8_norm_gpu.py): the
communicator with the fused kernel on, the cases (every pattern x weight
x dtype x shape, each with a seed of its own, on the "fused" route), an op
made late on a random rank with its inputs overwritten right after it, the
reference check, the same bits on every rank and the closing counts. A
helper module, not a test module."""
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

import tpcomm
from gpu_checks import delay_random_rank, overwrite
from tpcomm.config import Config
from tpcomm.norm_patterns import Pattern
from tpcomm.reference import reference_all_reduce_norm, ulp_distance

MiB = 1024 * 1024
EPS, NEXT_EPS = 1e-5, 1e-6
MAX_HIDDEN = tpcomm._lib.NORM_MAX_ROW_BYTES // 2  # 16-bit values in the kernel's longest row
SHAPES = [(1, 2048), (3, 2048), (8, 2048), (1, MAX_HIDDEN)]


def fused_comm():
    comm = tpcomm.Communicator(packet_max_bytes=1 * MiB, config=Config.from_env().replace(fused_kernel=True))
    assert comm.enabled, comm.disabled_reason
    return comm


def gathered(x):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


def shared(shape, dtype, seed):
    """Residual, weight and next weight, the same on every rank; weights in
    [-0.5, 0.5), so that 1 + w (Gemma's) is a plausible scale too."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    residual = torch.randn(shape, generator=g, device="cuda").to(dtype)
    weight, next_weight = ((torch.rand(shape[-1:], generator=g, device="cuda") - 0.5).to(dtype) for _ in range(2))
    return residual, weight, next_weight


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_on_every_rank(t, what):
    mine = bits(t).to(torch.int32)  # gloo (ranks sharing a GPU) gathers no 8- or 16-bit integers
    parts = gathered(mine)
    assert all(torch.equal(p, parts[0]) for p in parts), f"differs across ranks: {what}"


class Case(NamedTuple):
    pattern: Pattern
    offset: float
    inner: object  # the item of `inner` (None without)
    x: torch.Tensor  # this rank's input: integers in [-2, 2]
    residual: torch.Tensor
    weight: torch.Tensor
    nw: Optional[torch.Tensor]  # the next weight, NORM_ADD_NORM's only
    what: str


def cases(comm, rank, world, route, inner=(None,)):
    """Every pattern x offset (weight w, 1 + w) x dtype (bfloat16, float16) x
    shape of SHAPES x item of `inner` (enum members, named in `what`), in that
    order, each with a seed of its own; route(comm, pattern, x, weight, nw,
    offset) asserted "fused" before each is yielded."""
    seed = 0
    for pattern in Pattern:
        for offset in (0.0, 1.0):
            for dtype in (torch.bfloat16, torch.float16):
                for shape in SHAPES:
                    for item in inner:
                        seed += 1
                        g = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)
                        x = torch.randint(-2, 3, shape, generator=g, device="cuda").to(dtype)
                        residual, weight, next_weight = shared(shape, dtype, seed)
                        nw = next_weight if pattern == Pattern.NORM_ADD_NORM else None
                        what = (f"{pattern.name} weight {'1 + w' if offset else 'w'} "
                                f"{'' if item is None else item.name + ' '}{dtype} {shape} at {world} ranks")
                        assert route(comm, pattern, x, weight, nw, offset) == "fused", what
                        yield Case(pattern, offset, item, x, residual, weight, nw, what)


def late(rank, world, rng, x, residual, op):
    """op()'s result, a random rank (drawn from rng) made late before it and
    x and residual overwritten right after it."""
    delay_random_rank(rank, world, rng)
    out = op()
    overwrite(x)
    overwrite(residual)
    return out


def check_reference(case, kept_x, kept_r, normed, stream):
    """The stream output the reference's bits, the normed output within 1 ulp
    of it (bit for bit for NORM_ADD); kept_x and kept_r: the inputs as they
    were before the op."""
    ref_normed, ref_stream = reference_all_reduce_norm(gathered(kept_x), kept_r, case.weight, EPS, case.pattern,
                                                       case.offset, case.nw, NEXT_EPS)
    assert int(ulp_distance(stream, ref_stream).max()) == 0, f"stream {case.what}"
    normed_ulps = 0 if case.pattern == Pattern.NORM_ADD else 1
    assert int(ulp_distance(normed, ref_normed).max()) <= normed_ulps, f"normed {case.what}"


def check_counts_and_close(comm, expected):
    """After the last op: no error on comm, its calls counted as `expected`
    ({(key, route): calls}) and nothing else; closes comm."""
    torch.cuda.synchronize()
    comm.check()
    assert {k: v["calls"] for k, v in comm.stats().items()} == dict(expected), comm.stats()
    comm.close()
