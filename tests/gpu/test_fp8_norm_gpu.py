"""The FP8 epilogues of the fused kernel family (tpcomm.norm_fp8, route
"fused") on real GPUs, through the private op
torch.ops._tpcomm.all_reduce_norm_fp8 (and the public
custom_all_reduce_add_rms_norm_fp8 for ADD_NORM with weight w and m = 1):
every pattern x mode (per tensor, per token, per token group of 128) x its
vectors and residual scale (tests/gpu/fused_norm_cases.py: weight w or 1 + w,
a LayerNorm's weight and bias present or absent, m of 1, 0.75, -1.5), in
bfloat16 and float16, 1, 3 and 8 rows of 2048 and one row of
TPC_NORM_MAX_ROW_BYTES; a random rank late before every op and the inputs
overwritten right after it; every call on the "fused" route, counted once
under its pattern's fp8 key.

The kernel quantizes its own normed output rounded to the dtype, so with
return_normed=True the normed output is held to the bound
tests/gpu/test_norm_patterns_gpu.py holds it to (the reference within 1 ulp,
bit for bit for NORM_ADD and LAYER_NORM_ADD; the stream output bit for bit:
the inputs are integer rows, see there) and the codes and scales are
tpcomm.fp8.quantize of that normed output bit for bit (NaN codes compared by
position: the kernel writes 0x7f, torch keeps the sign). Without
return_normed, with the scales column-major, the same codes and scales. The
same bits on every rank. Then rows on their own: a NaN in one rank's input
makes its row's codes and scales NaN and no other row's; an all-zero row
gets the floor and codes 0; a small static scale saturates codes at +-448.

Runs at any world size from 2 to 8, with ranks sharing one GPU too
(TPCOMM_SHARE_GPU=1 TPCOMM_TEST_WORLD=N; tests/multiproc.py)."""
import collections

import pytest
import torch

import multiproc
from fused_norm_cases import EPS, NEXT_EPS, bits, cases, check_counts_and_close, check_reference, fused_comm, late, \
    same_on_every_rank, shared
from gpu_checks import delay_random_rank, shared_rng
from tpcomm import fp8, norm_fp8
from tpcomm.fp8 import Quant
from tpcomm.norm_fp8 import STATS_KEY
from tpcomm.norm_patterns import Pattern

pytestmark = pytest.mark.gpu

NAMES = {Quant.PER_TENSOR: "per_tensor", Quant.PER_TOKEN: "per_token", Quant.PER_TOKEN_GROUP: "per_token_group"}


def assert_same_bits(got, want, what):
    """Shape, strides, dtype and bits; NaNs compared by position."""
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype), \
        (what, got.shape, got.stride(), got.dtype, want.shape, want.stride(), want.dtype)
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan), f"NaN positions differ: {what}"
    assert torch.equal(bits(got)[~nan], bits(want)[~nan]), f"bits differ: {what}"


def _static_scale(quant, value):
    return torch.tensor([value], device="cuda") if quant == Quant.PER_TENSOR else None


def _fp8_call(comm, pattern, quant, x, residual, weight, nw, offset, scale, floor, column_major, return_normed,
              norm_args=(None, None, 1.0)):
    """(codes, scales, stream, normed or None) through the private op; norm_args: (bias, next_bias, residual_scale)."""
    codes, scales, stream, normed = torch.ops._tpcomm.all_reduce_norm_fp8(
        x, residual, weight, nw, EPS, NEXT_EPS, offset, int(pattern), int(quant), scale,
        fp8.DEFAULT_FLOOR.get(quant, 0.0) if floor is None else floor, column_major, return_normed, comm.group_name,
        *norm_args)
    assert return_normed or normed.numel() == 0
    return codes, scales, stream, normed if return_normed else None


def body_epilogues(rank, world):
    comm = fused_comm()
    rng = shared_rng(13)
    expected = collections.Counter()
    for case in cases(comm, rank, world, norm_fp8.route, inner=Quant):
        pattern, offset, quant, x, residual, weight, nw, what = case[:8]
        scale = _static_scale(quant, 0.0125)
        kept_x, kept_r = x.clone(), residual.clone()
        codes, scales, stream, normed = late(rank, world, rng, x, residual, lambda: _fp8_call(
            comm, pattern, quant, x, residual, weight, nw, offset, scale, None, False, True, case.norm_args()))
        expected[(STATS_KEY[pattern], "fused")] += 1
        check_reference(case, kept_x, kept_r, normed, stream)
        want_codes, want_scales = fp8.quantize(normed, quant, scale)
        assert_same_bits(codes, want_codes, f"codes {what}")
        assert_same_bits(scales, want_scales, f"scales {what}")
        for t, name in ((codes, "codes"), (scales, "scales"), (stream, "stream"), (normed, "normed")):
            same_on_every_rank(t, f"{name} {what}")
        # without the normed output, the scales column-major (but per tensor's one scale)
        column_major = quant != Quant.PER_TENSOR
        x, residual = kept_x.clone(), kept_r.clone()
        if pattern == Pattern.ADD_NORM and not offset and case.m == 1.0:
            codes2, scales2, stream2 = late(rank, world, rng, x, residual, lambda: (
                torch.ops.tpcomm.custom_all_reduce_add_rms_norm_fp8(
                    x, residual, weight, EPS, NAMES[quant], scale, None, column_major, comm.group_name)))
        else:
            codes2, scales2, stream2, _ = late(rank, world, rng, x, residual, lambda: _fp8_call(
                comm, pattern, quant, x, residual, weight, nw, offset, scale, None, column_major, False,
                case.norm_args()))
        expected[(STATS_KEY[pattern], "fused")] += 1
        want_codes, want_scales = fp8.quantize(normed, quant, scale, None, column_major)
        assert_same_bits(codes2, want_codes, f"codes without normed {what}")
        assert_same_bits(scales2, want_scales, f"column-major scales {what}")
        assert torch.equal(bits(stream2), bits(stream)), f"stream without normed {what}"
    check_counts_and_close(comm, expected)


def test_fp8_epilogues_on_the_fused_kernel():
    multiproc.run_gpu(body_epilogues, timeout=900)  # 108 cases x 3 modes, each twice


def body_rows(rank, world):
    """Rows on their own: row 0 has a NaN in the last rank's input, row 1 is
    all zero (every input and the residual), row 2 is large against a small
    static scale (saturates), the rest plain."""
    comm = fused_comm()
    rng = shared_rng(17)
    calls = collections.Counter()
    for pattern in Pattern:
        for quant in Quant:
            for dtype in (torch.bfloat16, torch.float16):
                shape = (5, 2048)
                seed = 100 * int(pattern) + 10 * int(quant) + (dtype == torch.float16)
                g = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)
                x = torch.randint(-2, 3, shape, generator=g, device="cuda").to(dtype)
                residual, weight, next_weight = shared(shape, dtype, seed)
                weight.add_(1.0)  # weights in [0.5, 1.5): no -0.0 in the zero row's normed output
                next_weight.add_(1.0)
                nw = next_weight if pattern == Pattern.NORM_ADD_NORM else None
                if rank == world - 1:
                    x[0, 7] = float("nan")
                x[1] = 0.0
                residual[1] = 0.0
                floor = 2.0 ** -12
                scale = _static_scale(quant, 1.0 / 1024)  # |normed| past 448 / 1024: saturates
                what = f"{pattern.name} {quant.name} {dtype} at {world} ranks"
                delay_random_rank(rank, world, rng)
                codes, scales, stream, normed = _fp8_call(comm, pattern, quant, x, residual, weight, nw, 0.0, scale,
                                                          None if quant == Quant.PER_TENSOR else floor, False, True)
                calls[(STATS_KEY[pattern], "fused")] += 1
                want_codes, want_scales = fp8.quantize(normed, quant, scale,
                                                       None if quant == Quant.PER_TENSOR else floor)
                assert_same_bits(codes, want_codes, f"codes {what}")
                assert_same_bits(scales, want_scales, f"scales {what}")
                q = codes.float()
                assert torch.isnan(q[0]).all() and not torch.isnan(q[1:]).any(), f"NaN row {what}"
                assert torch.isnan(normed[0]).all() and not torch.isnan(normed[1:]).any(), f"NaN normed {what}"
                assert not bits(codes[1]).any(), f"zero row codes {what}"
                if quant == Quant.PER_TENSOR:
                    assert (q[2:].abs() == 448).any(), f"no saturated code {what}"
                    assert bool((q[2:].abs() <= 448).all()), what
                else:
                    rows = scales.view(5, -1)
                    assert torch.isnan(rows[0]).all() and not torch.isnan(rows[1:]).any(), f"NaN scales {what}"
                    assert bool((rows[1] == floor).all()), f"zero row's scale {what}"
                    assert bool((q[2:].abs().amax(-1) == 448).all()), f"each row's amax code {what}"
                for t, name in ((codes, "codes"), (scales, "scales")):
                    same_on_every_rank(t, f"{name} {what}")
    check_counts_and_close(comm, calls)


def test_fp8_rows_nan_zero_and_saturated():
    multiproc.run_gpu(body_rows, timeout=300)
