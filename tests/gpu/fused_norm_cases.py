"""What the GPU tests of the fused kernel family share
(tests/gpu/test_norm_patterns_gpu.py, tests/gpu/test_fp8_norm_gpu.py): the
communicator with the fused kernel on, the cases (every pattern x its
vectors (weight w or 1 + w, a LayerNorm's weight and bias each present or
absent) x dtype x shape, each with a seed of its own and a residual scale m
of 1, 0.75 or -1.5 in turn, on the "fused" route), an op made late on a
random rank with its inputs overwritten right after it, the reference
check, the same bits on every rank and the closing counts. A helper module,
not a test module.

The ranks' rows are integers: a row of values in [-2, 2] summing to 0 plus
one integer c in [-1, 1] (per rank and row). So the sum s over up to 8 ranks
is an integer row whose mean is an integer, s - mean(s) too, and every row
sum of s, of s^2 and of (s - mean)^2 (at most 16384 x 24^2 < 2^24) is exact
in any order; a row of a power of two values makes the means exact. The
first norm's scale (RMSNorm's or LayerNorm's) is then the reference's bits:
see check_reference for what that makes exact."""
import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

import tpcomm
from gpu_checks import delay_random_rank, overwrite
from tpcomm.config import Config
from tpcomm.norm_patterns import LAYER_NORM, NEXT_NORM, Pattern
from tpcomm.reference import reference_all_reduce_norm, ulp_distance

MiB = 1024 * 1024
EPS, NEXT_EPS = 1e-5, 1e-6
MAX_HIDDEN = tpcomm._lib.NORM_MAX_ROW_BYTES // 2  # 16-bit values in the kernel's longest row
SHAPES = [(1, 2048), (3, 2048), (8, 2048), (1, MAX_HIDDEN)]
SCALES = (1.0, 0.75, -1.5)  # the residual scale m, by seed in turn
# (weight given, bias given, weight_offset) of each pattern's cases
RMS_VECTORS = ((True, False, 0.0), (True, False, 1.0))
LAYER_VECTORS = ((True, True, 0.0), (True, True, 1.0), (False, True, 0.0), (True, False, 0.0), (False, False, 0.0))


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


def biases(shape, dtype, seed):
    """A bias and a next bias, the same on every rank."""
    g = torch.Generator(device="cuda").manual_seed(7 * seed + 3)
    return tuple(torch.randn(shape[-1:], generator=g, device="cuda").to(dtype) for _ in range(2))


def rank_input(shape, dtype, seed, rank):
    """Integer rows: values in [-2, 2] summing to 0 (a half and its negation,
    in an order shared by the ranks) plus an integer c in [-1, 1] per row."""
    g = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)
    rows, n = math.prod(shape[:-1]), shape[-1]
    half = torch.randint(-2, 3, (rows, n // 2), generator=g, device="cuda")
    c = torch.randint(-1, 2, (rows, 1), generator=g, device="cuda")
    order = torch.randperm(n, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda")
    return (torch.cat((half, -half), 1)[:, order] + c).view(shape).to(dtype)


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
    x: torch.Tensor  # this rank's input: integers in [-3, 3] (rank_input)
    residual: torch.Tensor
    weight: Optional[torch.Tensor]  # None: a LayerNorm without weight
    nw: Optional[torch.Tensor]  # the next weight where the pattern has a second norm and a weight
    what: str
    bias: Optional[torch.Tensor]  # a LayerNorm's, or None
    nb: Optional[torch.Tensor]  # the next bias, beside a bias of a pattern with a second norm
    m: float  # the residual scale

    def norm_args(self):
        """What the private op takes after group_name: bias, next_bias, residual_scale."""
        return self.bias, self.nb, self.m


def cases(comm, rank, world, route, inner=(None,)):
    """Every pattern x its vectors (RMS_VECTORS, LAYER_VECTORS) x dtype
    (bfloat16, float16) x shape of SHAPES x item of `inner` (enum members,
    named in `what`), in that order (a LayerNorm pattern's vectors and shapes
    each in one of the dtypes, alternately), each with a seed of its own and
    m = SCALES[seed % 3]; route(comm, pattern, x, weight, nw, offset, bias, nb, m)
    asserted "fused" before each is yielded."""
    seed = 0
    for pattern in Pattern:
        layer = pattern in LAYER_NORM
        for v, (has_weight, has_bias, offset) in enumerate(LAYER_VECTORS if layer else RMS_VECTORS):
            for d, dtype in enumerate((torch.bfloat16, torch.float16)):
                for s, shape in enumerate(SHAPES):
                    if layer and (v + d + s) % 2:
                        continue  # a LayerNorm's vectors x shapes in one dtype each, alternately: half the cases
                    for item in inner:
                        seed += 1
                        x = rank_input(shape, dtype, seed, rank)
                        residual, weight, next_weight = shared(shape, dtype, seed)
                        bias, next_bias = biases(shape, dtype, seed)
                        second = pattern in NEXT_NORM
                        weight, nw = (weight, next_weight if second else None) if has_weight else (None, None)
                        bias, nb = (bias, next_bias if second else None) if has_bias else (None, None)
                        m = SCALES[seed % len(SCALES)]
                        what = (f"{pattern.name} weight {('1 + w' if offset else 'w') if has_weight else 'none'} "
                                f"bias {'b' if has_bias else 'none'} m {m} "
                                f"{'' if item is None else item.name + ' '}{dtype} {shape} at {world} ranks")
                        assert route(comm, pattern, x, weight, nw, offset, bias, nb, m) == "fused", what
                        yield Case(pattern, offset, item, x, residual, weight, nw, what, bias, nb, m)


def late(rank, world, rng, x, residual, op):
    """op()'s result, a random rank (drawn from rng) made late before it and
    x and residual overwritten right after it."""
    delay_random_rank(rank, world, rng)
    out = op()
    overwrite(x)
    overwrite(residual)
    return out


def check_reference(case, kept_x, kept_r, normed, stream):
    """The stream output the reference's bits (z = r + m*s is rounded from
    the same fp32 values; o = r + m*norm(s) takes the first norm's exact
    scale, see the module's doc), the normed output within 1 ulp of it (the
    norm of z or o sums values that are not integers, in the kernel's order;
    a LayerNorm's within 1 ulp plus layer_norm_slack, its bias can cancel),
    bit for bit for NORM_ADD and LAYER_NORM_ADD (normed is o); kept_x and
    kept_r: the inputs as they were before the op."""
    ref_normed, ref_stream = reference_all_reduce_norm(gathered(kept_x), kept_r, case.weight, EPS, case.pattern,
                                                       case.offset, case.nw, NEXT_EPS, case.bias, case.nb, case.m)
    assert int(ulp_distance(stream, ref_stream).max()) == 0, f"stream {case.what}"
    if case.pattern in (Pattern.NORM_ADD, Pattern.LAYER_NORM_ADD):
        assert int(ulp_distance(normed, ref_normed).max()) == 0, f"normed {case.what}"
    elif case.pattern in LAYER_NORM:
        diff = (normed.double() - ref_normed.double()).abs()
        allowed = ulp_of(ref_normed) + layer_norm_slack(case, ref_normed, ref_stream)
        assert bool((diff <= allowed).all()), f"normed {case.what}: {int((diff > allowed).sum())} values past the bound"
    else:
        assert int(ulp_distance(normed, ref_normed).max()) <= 1, f"normed {case.what}"


def ulp_of(t):
    """The spacing of t's dtype (float16 or bfloat16) at each value of t, in float64."""
    fraction_bits, smallest = (7, -133) if t.dtype == torch.bfloat16 else (10, -24)
    _, e = torch.frexp(t.double().abs())
    return torch.ldexp(torch.ones_like(t, dtype=torch.float64), (e - 1 - fraction_bits).clamp(min=smallest))


def layer_norm_slack(case, ref_normed, ref_stream):
    """How far the kernel's LayerNorm output may lie from the reference's
    before rounding, per value. Both take the row's mean and variance as
    fp32 sums of its N values in their own orders; a tree sum errs by at most
    ceil(log2 N) * 2^-24 of the sum of magnitudes, so the means differ by
    about 2 * ceil(log2 N) * 2^-24 * mean|v| and 1/sigma by that much
    relatively; t = (v - mean) / sigma * w' then by that bound (plus a few
    roundings) times |t| + |w'| * mean|v| / sigma. The bias is added to t
    exactly: where it cancels t, the output is small and those few fp32 ulps
    of t are many ulps of it. v is z (ADD_LAYER_NORM) or o (the second norm
    of LAYER_NORM_ADD_LAYER_NORM), the stream output."""
    second = case.pattern in NEXT_NORM
    weight, bias, eps = (case.nw, case.nb, NEXT_EPS) if second else (case.weight, case.bias, EPS)
    v = ref_stream.double()
    n = v.shape[-1]
    sigma = (v - v.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True).add(eps).sqrt()
    w = torch.ones_like(v[..., :1]) if weight is None else weight.double() + case.offset
    t = ref_normed.double() - (0.0 if bias is None else bias.double())
    k = 2 * math.ceil(math.log2(n)) + 4
    return k * 2.0 ** -24 * (t.abs() + w.abs() * v.abs().mean(-1, keepdim=True) / sigma)


def check_counts_and_close(comm, expected):
    """After the last op: no error on comm, its calls counted as `expected`
    ({(key, route): calls}) and nothing else; closes comm."""
    torch.cuda.synchronize()
    comm.check()
    assert {k: v["calls"] for k, v in comm.stats().items()} == dict(expected), comm.stats()
    comm.close()
