"""The LayerNorm members of tpcomm.norm_patterns and the residual scale m of
every member, on gloo ranks (the unfused route: the all-reduce in fp32, the
rest in torch): through torch.ops._tpcomm.all_reduce_norm and
all_reduce_norm_fp8, with and without weight and bias, m = 1 and others,
bf16, fp16 and fp32 on 2 and 3 ranks: the fp32 reference bit for bit, the
same bits on every rank, each call counted once under its pattern's key.
Then every refusal (before anything collective), m = 1 giving the bits of no
m, the reference's LayerNorm against torch.layer_norm, and the routes."""
import re

import pytest
import torch
import torch.distributed as dist

import tpcomm
from tpcomm import fp8, norm_patterns, routing
from tpcomm.fp8 import Quant
from tpcomm.norm_patterns import LAYER_NORM, NEXT_NORM, STATS_KEY, Pattern
from tpcomm.reference import reference_all_reduce_norm, ulp_distance

from multiproc import run_ranks
from norm_helpers import pattern_inputs, pattern_shared, seeded
from routing_only import meta, routing_comm

EPS, NEXT_EPS = 1e-5, 1e-6
SCALES = (1.0, 0.5, -1.25, 0.7)  # 0.7 is not an fp32: the op and the reference both round it


def _vectors(pattern, shape, dtype, seed, has_weight, has_bias):
    """(residual, weight, bias, next_weight, next_bias), each norm's weight and bias as asked."""
    residual, weight, next_weight = pattern_shared(shape, dtype, seed)
    g = torch.Generator().manual_seed(31 * seed)
    bias, next_bias = (torch.randn(shape[-1:], generator=g).to(dtype) for _ in range(2))
    second = pattern in NEXT_NORM
    return (residual, weight if has_weight else None, bias if has_bias else None,
            next_weight if second and (has_weight or pattern == Pattern.NORM_ADD_NORM) else None,
            next_bias if second and has_bias else None)


def _same_on_every_rank(t, world_size, what):
    gathered = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(gathered, t)
    assert all(torch.equal(g, gathered[0]) for g in gathered), f"ranks differ: {what}"


def _body_members(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    expected = dict.fromkeys(STATS_KEY.values(), 0)
    cases = seeded(Pattern, ((True, True), (True, False), (False, True), (False, False)), SCALES,
                   ((torch.bfloat16, (3, 128)), (torch.float16, (2, 2, 64)), (torch.float32, (1, 256))))
    for seed, pattern, (has_weight, has_bias), m, (dtype, shape) in cases:
        if pattern not in LAYER_NORM and (has_bias or not has_weight):
            continue  # an RMS member takes a weight and no bias (refusals below)
        every = [pattern_inputs(r, shape, dtype, seed) for r in range(world_size)]
        residual, weight, bias, nw, nb = _vectors(pattern, shape, dtype, seed, has_weight, has_bias)
        offset = float(seed % 2) if has_weight else 0.0
        normed, stream = torch.ops._tpcomm.all_reduce_norm(every[rank], residual, weight, nw, EPS, NEXT_EPS, offset,
                                                           int(pattern), comm.group_name, bias, nb, m)
        expected[STATS_KEY[pattern]] += 1
        ref = reference_all_reduce_norm(every, residual, weight, EPS, pattern, offset, nw, NEXT_EPS, bias, nb, m)
        what = f"{pattern.name} weight {has_weight} bias {has_bias} m {m} offset {offset} {dtype} {shape}"
        assert int(ulp_distance(normed, ref[0]).max()) == 0, f"normed {what}"
        assert int(ulp_distance(stream, ref[1]).max()) == 0, f"stream {what}"
        assert normed.data_ptr() != stream.data_ptr()
        if m == 1.0:  # multiplying by 1 is exact: the op without m gives the same bits
            again = torch.ops._tpcomm.all_reduce_norm(every[rank], residual, weight, nw, EPS, NEXT_EPS, offset,
                                                      int(pattern), comm.group_name, bias, nb)
            expected[STATS_KEY[pattern]] += 1
            assert torch.equal(again[0], normed) and torch.equal(again[1], stream), what
        for t in (normed, stream):
            _same_on_every_rank(t, world_size, what)
    stats = comm.stats()
    assert {op: v["calls"] for (op, _), v in stats.items()} == {k: n for k, n in expected.items() if n}, stats
    assert all(n for n in expected.values())
    comm.close()


def test_members_on_two_ranks():
    run_ranks(2, _body_members, timeout=300)


def test_members_on_three_ranks():
    run_ranks(3, _body_members, timeout=300)


def _body_fp8(rank, world_size):
    """The FP8 epilogue after a LayerNorm and after a scaled residual: codes
    and scales fp8.quantize of the reference's normed output, bit for bit."""
    comm = tpcomm.Communicator(device="cpu")
    shape, dtype = (3, 256), torch.bfloat16
    for seed, pattern, quant in seeded((Pattern.ADD_LAYER_NORM, Pattern.LAYER_NORM_ADD,
                                        Pattern.LAYER_NORM_ADD_LAYER_NORM, Pattern.NORM_ADD), Quant):
        every = [pattern_inputs(r, shape, dtype, seed) for r in range(world_size)]
        residual, weight, bias, nw, nb = _vectors(pattern, shape, dtype, seed, True, pattern in LAYER_NORM)
        scale = torch.tensor([0.0625]) if quant == Quant.PER_TENSOR else None
        floor = fp8.DEFAULT_FLOOR.get(quant, 0.0)
        codes, scales, stream, normed = torch.ops._tpcomm.all_reduce_norm_fp8(
            every[rank], residual, weight, nw, EPS, NEXT_EPS, 0.0, int(pattern), int(quant), scale, floor, False,
            True, comm.group_name, bias, nb, -0.75)
        ref_normed, ref_stream = reference_all_reduce_norm(every, residual, weight, EPS, pattern, 0.0, nw, NEXT_EPS,
                                                           bias, nb, -0.75)
        want_codes, want_scales = fp8.quantize(ref_normed, quant, scale, None if quant == Quant.PER_TENSOR else floor)
        what = f"{pattern.name} {quant.name}"
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), what
        assert torch.equal(scales, want_scales), what
        assert torch.equal(stream, ref_stream) and torch.equal(normed, ref_normed), what
    assert {route for _, route in comm.stats()} == {"unfused"}, comm.stats()
    assert sum(v["calls"] for v in comm.stats().values()) == 12
    comm.close()


def test_fp8_epilogue_after_layer_norm_and_scaled_residual():
    run_ranks(2, _body_fp8, timeout=300)


# ------------------------------------------------------------------ refusals

def _refusals():
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    v = torch.ones(64, dtype=torch.bfloat16)
    P = Pattern
    return [  # (pattern, weight, next_weight, offset, bias, next_bias, m), the words of the error
        ((P.NORM_ADD, v, None, 0.0, v, None, 1.0), "takes no bias"),
        ((P.ADD_NORM, v, None, 0.0, v, None, 1.0), "takes no bias"),
        ((P.NORM_ADD_NORM, v, v, 0.0, None, v, 1.0), "takes no bias"),
        ((P.ADD_NORM, None, None, 0.0, None, None, 1.0), "takes a weight"),
        ((P.NORM_ADD_NORM, v, None, 0.0, None, None, 1.0), "takes a next_weight"),
        ((P.LAYER_NORM_ADD, v, v, 0.0, None, None, 1.0), "takes no next_weight"),
        ((P.ADD_LAYER_NORM, v, None, 0.0, None, v, 1.0), "takes no next_bias"),
        ((P.ADD_LAYER_NORM, None, None, 1.0, v, None, 1.0), "a LayerNorm without weight takes weight_offset 0"),
        ((P.LAYER_NORM_ADD_LAYER_NORM, v, None, 1.0, None, None, 1.0), "needs every norm's weight"),
        ((P.ADD_LAYER_NORM, v, None, 0.5, None, None, 1.0), "weight_offset=0.5"),
        ((P.ADD_LAYER_NORM, v, None, 0.0, v[:32], None, 1.0), "bias must be a floating-point vector"),
        ((P.LAYER_NORM_ADD, v, None, 0.0, v.to(torch.int32), None, 1.0), "bias must be a floating-point vector"),
        ((P.LAYER_NORM_ADD_LAYER_NORM, v, v[:8], 0.0, None, None, 1.0), "next_weight must be"),
        ((P.ADD_LAYER_NORM, v, None, 0.0, None, None, float("inf")), "residual_scale=inf"),
        ((P.ADD_NORM, v, None, 0.0, None, None, float("nan")), "residual_scale=nan"),
        ((P.LAYER_NORM_ADD, v, None, 0.0, None, None, 1e39), "(in fp32)"),  # finite, but not in fp32
        ((6, v, None, 0.0, None, None, 1.0), "unknown fusion pattern 6"),
    ], x


def test_check_args_refuses_each_bad_argument():
    cases, x = _refusals()
    for (pattern, w, nw, offset, b, nb, m), words in cases:
        with pytest.raises(ValueError, match=re.escape(words)):
            norm_patterns.check_args(pattern, x, x, w, nw, EPS, NEXT_EPS, offset, b, nb, m)
    v = torch.ones(64)
    with pytest.raises(ValueError, match="eps"):  # the next norm's eps is held to the same rule
        norm_patterns.check_args(Pattern.LAYER_NORM_ADD_LAYER_NORM, x, x, None, None, EPS, -1.0, 0.0)
    norm_patterns.check_args(Pattern.LAYER_NORM_ADD_LAYER_NORM, x, x, None, None, EPS, NEXT_EPS, 0.0)  # all optional
    norm_patterns.check_args(Pattern.ADD_LAYER_NORM, x, x, v, None, EPS, NEXT_EPS, 1.0, v, None, -3)


def _body_refusals(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    cases, x = _refusals()
    for (pattern, w, nw, offset, b, nb, m), words in cases:
        with pytest.raises(ValueError, match=re.escape(words)):
            torch.ops._tpcomm.all_reduce_norm(x, x, w, nw, EPS, NEXT_EPS, offset, int(pattern), comm.group_name, b,
                                              nb, m)
        with pytest.raises(ValueError, match=re.escape(words)):
            torch.ops._tpcomm.all_reduce_norm_fp8(x, x, w, nw, EPS, NEXT_EPS, offset, int(pattern),
                                                  int(Quant.PER_TOKEN), None, 1e-3, False, False, comm.group_name,
                                                  b, nb, m)
    assert comm.stats() == {}  # nothing ran, and every rank is still in step:
    y = torch.full((2, 64), float(rank + 1))
    normed, stream = torch.ops._tpcomm.all_reduce_norm(y, y, None, None, EPS, NEXT_EPS, 0.0,
                                                       int(Pattern.ADD_LAYER_NORM), comm.group_name)
    assert bool((normed == 0).all())  # a constant row has no spread
    comm.close()


def test_refusals_through_the_ops_before_anything_collective():
    run_ranks(2, _body_refusals, timeout=300)


# ------------------------------------------------------------------ definition and routes

def test_reference_layer_norm_is_torchs():
    """The reference's LayerNorm (the all-reduce of one rank) is torch.layer_norm's,
    biased variance and bias included, within fp32's rounding of another order."""
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(5, 384, generator=g) * 3 + 1, torch.randn(5, 384, generator=g)
    w, b = torch.randn(384, generator=g), torch.randn(384, generator=g)
    normed, z = reference_all_reduce_norm([x], r, w, 1e-5, Pattern.ADD_LAYER_NORM, bias=b, residual_scale=0.5)
    assert torch.equal(z, r + 0.5 * x)
    torch.testing.assert_close(normed, torch.nn.functional.layer_norm(r + 0.5 * x, (384,), w, b, 1e-5),
                               rtol=1e-5, atol=1e-5)
    normed, o = reference_all_reduce_norm([x], r, None, 1e-5, Pattern.LAYER_NORM_ADD)
    torch.testing.assert_close(o, r + torch.nn.functional.layer_norm(x, (384,), eps=1e-5), rtol=1e-5, atol=1e-5)
    assert torch.equal(normed, o)


def test_routes_of_the_new_members():
    """The fused kernel family takes every pattern, with any residual scale;
    ADD_NORM with m != 1 is never
    all_reduce_add_rms_norm's "split"; a bias of another dtype stays unfused."""
    bf16 = torch.bfloat16
    for add_norm in ("fused", "split", "unfused", "single rank"):
        for pattern in Pattern:
            for m in (1.0, 0.5):
                got = routing.norm_pattern(add_norm, pattern, 0.0, bf16, None, bf16, residual_scale=m)
                if pattern == Pattern.ADD_NORM and m == 1.0:
                    assert got == add_norm
                else:
                    assert got == ("fused" if add_norm == "fused" else "unfused"), (add_norm, pattern, m)
    assert routing.norm_pattern("fused", Pattern.ADD_LAYER_NORM, 0.0, bf16, None, torch.float32) == "unfused"
    c, w = routing_comm(), meta((4096,))
    decode, prefill = meta((8, 4096)), meta((130, 4096))
    assert norm_patterns.route(c, Pattern.ADD_NORM, prefill, w, None, 0.0, residual_scale=0.5) == "unfused"
    for pattern in LAYER_NORM:
        assert norm_patterns.route(c, pattern, decode, None, None, 0.0, w) == "fused"
        assert norm_patterns.route(c, pattern, prefill, w, None, 0.0) == "unfused"


class _RecordingKernels:
    """Stands in for backends.kernels.Kernels: records what the fused route hands the kernel family."""

    def __init__(self):
        self.calls = []

    def all_reduce_norm(self, pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset, normed,
                        stream_out, bias=None, next_bias=None, residual_scale=1.0):
        self.calls.append((pattern, weight, next_weight, bias, next_bias, weight_offset, residual_scale))
        normed.fill_(1.0)
        stream_out.fill_(2.0)


def test_fused_route_hands_the_kernel_the_vectors_and_the_scale():
    """Each member on the fused route: the vectors as given (None where
    absent, contiguous), m rounded to fp32; ADD_NORM with m != 1 too (not
    all_reduce_add_rms_norm); counted once under the pattern's key."""
    c = routing_comm()
    c._kernels, c._stat_cells = _RecordingKernels(), {}
    x, residual = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)
    w, b = torch.randn(64, dtype=torch.bfloat16), torch.randn(128, dtype=torch.bfloat16)[::2]  # b not contiguous
    for pattern, weight, nw, bias, nb, m in ((Pattern.ADD_LAYER_NORM, w, None, b, None, 0.7),
                                             (Pattern.LAYER_NORM_ADD, None, None, None, None, 1.0),
                                             (Pattern.LAYER_NORM_ADD_LAYER_NORM, w, w, b, b, -2.0),
                                             (Pattern.ADD_NORM, w, None, None, None, 0.5)):
        normed, stream = norm_patterns.run(c, int(pattern), x, residual, weight, nw, EPS, NEXT_EPS, 0.0, bias, nb, m)
        got = c._kernels.calls[-1]
        assert got[0] == pattern and got[1] is weight and got[2] is nw, pattern
        for handed, given in ((got[3], bias), (got[4], nb)):
            assert (handed is None) == (given is None) and (given is None or handed.is_contiguous() and
                                                            torch.equal(handed, given)), pattern
        assert got[6] == norm_patterns.fp32_scale(m) and (m != 0.7 or got[6] != 0.7), (pattern, got[6])
        assert bool((normed == 1).all()) and bool((stream == 2).all())
    assert c.stats() == {(STATS_KEY[p], "fused"): {"calls": 1, "bytes": x.numel() * 2}
                         for p in (Pattern.ADD_LAYER_NORM, Pattern.LAYER_NORM_ADD, Pattern.LAYER_NORM_ADD_LAYER_NORM,
                                   Pattern.ADD_NORM)}
