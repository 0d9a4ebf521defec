"""The fusion patterns with an FP8 epilogue (tpcomm.norm_fp8) on gloo ranks,
where the unfused route runs them: through the private op
torch.ops._tpcomm.all_reduce_norm_fp8, the public
torch.ops.tpcomm.custom_all_reduce_add_rms_norm_fp8 and
Communicator.all_reduce_add_rms_norm_fp8, every pattern x mode x weight
(w, 1 + w) x scales' layout, on 2 and 3 ranks: codes and scales bit for bit
fp8.quantize of the normed output computed here from the ranks' inputs (the
fp32 sum in rank order, tpcomm.reference), the stream and normed outputs
that reference bit for bit, NaN rows where a rank's input has one and
nowhere else, all-zero rows at the floor, the same bits on every rank, each
call counted once under its pattern's fp8 key and route "unfused". Then the
routes (fused where the pattern is, on CUDA builds only), what the fused
route hands the kernel, argument errors before anything collective, the
fallback's agreement check, the refused backward and a closed communicator.
tests/test_fp8_ops_cpu.py holds the ops' schemas and fakes."""
import re

import pytest
import torch
import torch.distributed as dist

import tpcomm
from tpcomm import _constants as C
from tpcomm import fp8, norm_fp8, routing
from tpcomm.fp8 import Quant
from tpcomm.norm_fp8 import STATS_KEY
from tpcomm.norm_patterns import NEXT_NORM, Pattern
from tpcomm.reference import reference_all_reduce_norm

from multiproc import run_ranks
from norm_helpers import pattern_inputs, pattern_shared, seeded
from routing_only import meta, routing_comm

EPS, NEXT_EPS = 1e-5, 1e-6


def _bits(t):
    return t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2
                               else torch.int32)


def assert_same_bits(got, want, what):
    """Bit for bit, NaNs compared by position (torch keeps a NaN's sign, the kernel writes 0x7f)."""
    assert got.shape == want.shape and got.dtype == want.dtype and got.stride() == want.stride(), \
        (what, got.shape, want.shape, got.dtype, want.dtype, got.stride(), want.stride())
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan), f"NaN positions differ: {what}"
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan]), f"bits differ: {what}"


def _same_on_every_rank(t, world_size, what):
    mine = _bits(t).to(torch.int32)  # gloo gathers no 8- or 16-bit integers
    parts = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(parts, mine)
    assert all(torch.equal(p, parts[0]) for p in parts), f"ranks differ: {what}"


def _call(entry, comm, pattern, quant, x, residual, weight, nw, offset, scale, floor, column_major, return_normed):
    """(codes, scales, stream, normed or None) through one entry point."""
    if entry == "private":
        out = torch.ops._tpcomm.all_reduce_norm_fp8(x, residual, weight, nw, EPS, NEXT_EPS, offset, int(pattern),
                                                    int(quant), scale, fp8.DEFAULT_FLOOR.get(quant, 0.0)
                                                    if floor is None else floor,
                                                    column_major, return_normed, comm.group_name)
        if not return_normed:
            assert out[3].numel() == 0 and out[3].dtype == x.dtype
        return out[:3] + ((out[3],) if return_normed else (None,))
    name = {Quant.PER_TENSOR: "per_tensor", Quant.PER_TOKEN: "per_token", Quant.PER_TOKEN_GROUP: "per_token_group"}
    if entry == "public":
        return torch.ops.tpcomm.custom_all_reduce_add_rms_norm_fp8(x, residual, weight, EPS, name[quant], scale,
                                                                   floor, column_major, comm.group_name) + (None,)
    out = comm.all_reduce_add_rms_norm_fp8(x, residual, weight, EPS, name[quant], scale=scale, scale_floor=floor,
                                           column_major_scales=column_major, return_normed=return_normed)
    assert isinstance(out, norm_fp8.Fp8Norm) and (out.normed is None) != return_normed
    return tuple(out)


def _body_patterns(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    expected = dict.fromkeys(STATS_KEY.values(), 0)
    cases = seeded(Pattern, (0.0, 1.0), Quant, (False, True),
                   ((torch.bfloat16, (3, 256)), (torch.float16, (2, 2, 384)), (torch.float32, (4, 128))))
    for seed, pattern, offset, quant, column_major, (dtype, shape) in cases:
        if column_major and len(shape) != 2:
            continue
        every = [pattern_inputs(r, shape, dtype, seed) for r in range(world_size)]
        residual, weight, next_weight = pattern_shared(shape, dtype, seed)
        if seed % 3 == 0:  # a NaN in rank 1's row 0, an all-zero row 1 (residual too)
            every[1].view(-1, shape[-1])[0, 5] = float("nan")
            for t in (residual, *every):
                t.view(-1, shape[-1])[1] = 0.0
        x = every[rank].clone()
        nw = next_weight if pattern in NEXT_NORM else None
        scale = torch.tensor([0.0625 + 0.01 * seed]) if quant == Quant.PER_TENSOR else None
        floor = None if quant == Quant.PER_TENSOR else (None, 1e-3)[seed % 2]
        what = (f"{pattern.name} offset {offset} {quant.name} column-major {column_major} {dtype} {shape} "
                f"on {world_size} ranks")
        if column_major and quant == Quant.PER_TENSOR:
            with pytest.raises(ValueError, match="per_tensor has one scale"):
                _call("private", comm, pattern, quant, x, residual, weight, nw, offset, scale, floor, True, False)
            continue
        entry = ("public" if pattern == Pattern.ADD_NORM and not offset and seed % 2 else
                 "method" if pattern == Pattern.ADD_NORM and not offset else "private")
        return_normed = entry != "public" and seed % 4 < 2
        codes, scales, stream, normed = _call(entry, comm, pattern, quant, x, residual, weight, nw, offset, scale,
                                              floor, column_major, return_normed)
        expected[STATS_KEY[pattern]] += 1
        ref_normed, ref_stream = reference_all_reduce_norm(every, residual, weight, EPS, pattern, offset, nw, NEXT_EPS)
        want_codes, want_scales = fp8.quantize(ref_normed, quant, scale, floor, column_major)
        assert_same_bits(codes, want_codes, f"codes {what}")
        assert_same_bits(scales, want_scales, f"scales {what}")
        assert_same_bits(stream, ref_stream, f"stream {what}")
        assert stream.is_contiguous() and codes.is_contiguous()
        if return_normed:
            assert_same_bits(normed, ref_normed, f"normed {what}")
        if seed % 3 == 0:  # the NaN row only; the zero row at the floor (its codes 0)
            rows = codes.view(-1, shape[-1]).float()
            assert torch.isnan(rows[0]).any() and not torch.isnan(rows[1:]).any(), what
            if quant != Quant.PER_TENSOR:
                z = scales.reshape(-1, scales.shape[-1])[1]
                f = fp8.DEFAULT_FLOOR[quant] if floor is None else floor
                assert bool((z == torch.tensor(f, dtype=torch.float32)).all()), what
            assert bool((codes.view(-1, shape[-1])[1].float() == 0).all()), what  # +-0
        for t in (codes, scales, stream):
            _same_on_every_rank(t, world_size, what)
    got = {op: v["calls"] for (op, route), v in comm.stats().items()}
    assert got == {k: n for k, n in expected.items() if n}, comm.stats()
    assert {route for _, route in comm.stats()} == {"unfused"}, comm.stats()
    comm.close()


def test_patterns_on_two_ranks():
    run_ranks(2, _body_patterns, timeout=300)


def test_patterns_on_three_ranks():
    run_ranks(3, _body_patterns, timeout=300)


# ------------------------------------------------------------------ routes

def test_route_is_the_patterns_fused_route_on_cuda_builds_only():
    c, w = routing_comm(), meta((4096,))
    decode, prefill = meta((8, 4096)), meta((130, 4096))
    for pattern in Pattern:
        nw = w if pattern in NEXT_NORM else None
        for offset in (0.0, 1.0):
            assert norm_fp8.route(c, pattern, decode, w, nw, offset) == "fused", (pattern, offset)
            assert norm_fp8.route(c, pattern, prefill, w, nw, offset) == "unfused"  # "split" for ADD_NORM, w
            assert norm_fp8.route(routing_comm(fused_kernel=False), pattern, decode, w, nw, offset) == "unfused"
            assert norm_fp8.route(routing_comm(enabled=False), pattern, decode, w, nw, offset) == "unfused"
            rocm = routing_comm()
            rocm._caps = rocm._caps._replace(platform=C.TPC_PLATFORM_ROCM)
            assert norm_fp8.route(rocm, pattern, decode, w, nw, offset) == "unfused"
    for how in ("split", "unfused", "single rank", "nccl", "gloo"):
        assert routing.norm_fp8(how, C.TPC_PLATFORM_CUDA) == "unfused"
    assert routing.norm_fp8("fused", C.TPC_PLATFORM_CUDA) == "fused" and routing.norm_fp8("fused", C.TPC_PLATFORM_ROCM) == "unfused"


class _RecordingKernels:
    """Stands in for backends.kernels.Kernels: records what the fused route
    hands the kernel and writes distinct values into its outputs."""

    def __init__(self):
        self.calls = []

    def all_reduce_norm_quant(self, pattern, quant, x, residual, weight, next_weight, eps, next_eps, weight_offset,
                              scale_floor, normed, stream_out, codes, scales, bias=None, next_bias=None,
                              residual_scale=1.0):
        assert (bias, next_bias, residual_scale) == (None, None, 1.0)
        self.calls.append(dict(pattern=pattern, quant=quant, x=x, residual=residual, weight=weight,
                               next_weight=next_weight, eps=eps, next_eps=next_eps, weight_offset=weight_offset,
                               floor=scale_floor, normed=normed, stream=stream_out, codes=codes, scales=scales))
        if normed is not None:
            normed.fill_(1.0)
        stream_out.fill_(2.0)
        codes.fill_(3.0)
        if quant != Quant.PER_TENSOR:
            scales.fill_(4.0)


def test_fused_route_hands_the_kernel_its_outputs_and_counts_once():
    c = routing_comm()
    c._kernels, c._stat_cells, c.device = _RecordingKernels(), {}, torch.device("cpu")
    x = torch.randn(4, 512, dtype=torch.bfloat16)[:, ::2]  # not contiguous: the kernel gets a contiguous copy
    residual = torch.randn(4, 256, dtype=torch.bfloat16)
    w, nw = torch.randn(256, dtype=torch.bfloat16), torch.randn(256, dtype=torch.bfloat16)
    scale = torch.tensor(0.5)
    calls = 0
    for pattern in Pattern:
        next_weight = nw if pattern in NEXT_NORM else None
        for quant in Quant:
            for column_major in ((False,) if quant == Quant.PER_TENSOR else (False, True)):
                for return_normed in (False, True):
                    s = scale if quant == Quant.PER_TENSOR else None
                    out = norm_fp8.run(c, int(pattern), quant, x, residual, w, next_weight, 1e-5, 1e-6, 1.0, s, None,
                                       column_major, return_normed)
                    calls += 1
                    got = c._kernels.calls[-1]
                    assert got["pattern"] == pattern and got["quant"] == quant and isinstance(got["quant"], Quant)
                    assert (got["eps"], got["next_eps"], got["weight_offset"]) == (1e-5, 1e-6, 1.0)
                    assert got["floor"] == (0.0 if quant == Quant.PER_TENSOR else fp8.DEFAULT_FLOOR[quant])
                    assert got["x"].is_contiguous() and torch.equal(got["x"], x) and got["residual"] is residual
                    assert got["weight"] is w and got["next_weight"] is next_weight
                    assert (got["normed"] is None) != return_normed and (out.normed is None) != return_normed
                    assert got["codes"] is out.codes and got["scales"] is out.scales and got["stream"] is out.summed
                    assert out.codes.dtype == torch.float8_e4m3fn and out.codes.shape == x.shape
                    assert out.codes.is_contiguous() and bool((out.codes.float() == 3).all())
                    assert bool((out.summed == 2).all()) and (not return_normed or bool((out.normed == 1).all()))
                    if quant == Quant.PER_TENSOR:
                        assert out.scales.shape == (1,) and out.scales.item() == 0.5
                        assert out.scales.data_ptr() != scale.data_ptr()
                    else:
                        groups = 1 if quant == Quant.PER_TOKEN else 2
                        assert out.scales.shape == (4, groups) and bool((out.scales == 4).all())
                        assert out.scales.stride() == ((1, 4) if column_major else (groups, 1))
    assert len(c._kernels.calls) == calls
    n = calls // len(Pattern)
    assert c.stats() == {(STATS_KEY[p], "fused"): {"calls": n, "bytes": n * x.numel() * 2} for p in Pattern}


# -------------------------------------------------------------- errors

def _body_errors(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    x, w = torch.ones(2, 256, dtype=torch.bfloat16), torch.ones(256, dtype=torch.bfloat16)
    name = comm.group_name
    cases = [
        (lambda: comm.all_reduce_add_rms_norm_fp8(x[:, :192], x[:, :192], w[:192], 1e-6, "per_token_group"),
         ValueError, "multiple of 128, got 192"),
        (lambda: comm.all_reduce_add_rms_norm_fp8(x, x, w, 1e-6, "per_tensor", scale=torch.ones(1).double()),
         TypeError, "scale must be float32"),
        (lambda: comm.all_reduce_add_rms_norm_fp8(x, x, w, 1e-6, "per_tensor", scale=torch.ones(2)),
         ValueError, "one element"),
        (lambda: comm.all_reduce_add_rms_norm_fp8(x, x, w, 1e-6, "per_token", scale_floor=0.0),
         ValueError, "finite and > 0"),
        (lambda: comm.all_reduce_add_rms_norm_fp8(x.view(2, 1, 256), x.view(2, 1, 256), w, 1e-6, "per_token_group",
                                                  column_major_scales=True), ValueError, "2-D input"),
        (lambda: comm.all_reduce_add_rms_norm_fp8(x, x, w, 1e-6, "fp8"), ValueError, "unknown FP8 quantization"),
        (lambda: comm.all_reduce_add_rms_norm_fp8(x, x[:1], w, 1e-6, "per_token"), ValueError, "residual"),
        (lambda: comm.all_reduce_add_rms_norm_fp8(x, x, w, 1e-6, "per_token", scale=torch.ones(1, device="meta")),
         ValueError, "scale is on meta"),
        (lambda: torch.ops.tpcomm.custom_all_reduce_add_rms_norm_fp8(x, x, w, 1e-6, "per_block", None, None, False,
                                                                     name), ValueError, "unknown FP8 quantization"),
        (lambda: torch.ops._tpcomm.all_reduce_norm_fp8(x, x, w, None, 1e-6, 1e-6, 0.0, 1, 9, None, 1e-3, False,
                                                       False, name), ValueError, "unknown FP8 quantization 9"),
        (lambda: torch.ops._tpcomm.all_reduce_norm_fp8(x, x, w, None, 1e-6, 1e-6, 0.0, 1, 2, None, -1.0, False,
                                                       False, name), ValueError, "finite and > 0"),
        (lambda: torch.ops._tpcomm.all_reduce_norm_fp8(x, x, w, None, 1e-6, 1e-6, 0.0, 2, 2, None, 1e-3, False,
                                                       False, name), ValueError, "next_weight"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=re.escape(words)):
            call()
    assert comm.stats() == {}  # nothing ran
    # a call the ranks disagree on stops on the fallback's agreement check, on every rank
    rows = 2 if rank == 0 else 4
    with pytest.raises(tpcomm.CollectiveMismatch, match=r"shape differs.*all_reduce_add_rms_norm_fp8"):
        comm.all_reduce_add_rms_norm_fp8(torch.ones(rows, 256), torch.ones(rows, 256), torch.ones(256), 1e-6,
                                         "per_token")
    assert comm.stats() == {}
    # inputs that require grad: the forward runs, a backward through it raises
    xg = torch.ones(2, 256, requires_grad=True)
    out = comm.all_reduce_add_rms_norm_fp8(xg, torch.ones(2, 256), torch.ones(256), 1e-6, "per_token",
                                           return_normed=True)
    assert out.codes.float().eq(448).all() and out.summed.eq(world_size + 1).all()
    with pytest.raises(RuntimeError, match="all_reduce_add_rms_norm_fp8 has no backward"):
        out.normed.sum().backward()
    comm.close()
    for call in (lambda: comm.all_reduce_add_rms_norm_fp8(x, x, w, 1e-6, "per_token"),
                 lambda: tpcomm.norm_fp8.run(comm, 1, "per_token", x, x, w, None, 1e-6, 1e-6, 0.0)):
        with pytest.raises(tpcomm.CommunicatorClosed):
            call()
    with pytest.raises(tpcomm.CommunicatorClosed):
        torch.ops.tpcomm.custom_all_reduce_add_rms_norm_fp8(x, x, w, 1e-6, "per_token", None, None, False, name)


def test_errors_closed_agreement_and_backward():
    run_ranks(2, _body_errors, timeout=300)
