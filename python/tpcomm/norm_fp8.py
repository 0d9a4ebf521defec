"""The fusion patterns of tpcomm.norm_patterns with an FP8 epilogue: the
pattern's normed output, rounded to the input's dtype as the pattern writes
it, quantized to e4m3 by tpcomm.fp8 (per tensor with a given scale, per
token, or per token group of 128), for the FP8 GEMM that reads it next.
run() returns Fp8Norm(codes, scales, summed, normed): summed is the pattern's
stream output in the input's dtype (z, o), normed its normed output in that
dtype where return_normed asks for it, else None.

Routes (route()): "fused", one launch of the fused kernel family with the
epilogue (Kernels.all_reduce_norm_quant), where the pattern itself runs
"fused" (tpcomm.routing.norm_pattern) in a CUDA build (the epilogues refuse
on ROCm); anything else "unfused": the all-reduce in fp32 through the
Communicator's route (uncounted; the fallback's agreement check where that
route is the fallback), the pattern in torch in fp32, rounded to the dtype,
then fp8.quantize. Both quantize the same rounded normed output, so the
codes and scales are fp8.quantize(normed) of that route's normed output bit
for bit. Each call counts once in stats() under STATS_KEY[pattern] and the
route that ran."""
import typing

import torch

from . import _autograd, add_rms_norm, fp8, norm_patterns, routing
from .norm_patterns import Pattern

# The key each pattern's FP8 calls count under in Communicator.stats()
STATS_KEY = {pattern: f"{key}_fp8" for pattern, key in norm_patterns.STATS_KEY.items()}


class Fp8Norm(typing.NamedTuple):
    codes: torch.Tensor  # float8_e4m3fn, the input's shape, contiguous
    scales: torch.Tensor  # float32 (fp8.empty_outputs gives the layout)
    summed: torch.Tensor  # the stream output (z, o) in the input's dtype
    normed: "torch.Tensor | None"  # the normed output in the input's dtype, where asked for


def route(comm, pattern, x, weight, next_weight, weight_offset, bias=None, next_bias=None, residual_scale=1.0):
    """How run() takes this call: "fused" or "unfused"."""
    how = norm_patterns.route(comm, pattern, x, weight, next_weight, weight_offset, bias, next_bias, residual_scale)
    return routing.norm_fp8(how, comm.caps.platform if comm.caps is not None else None)


def run(comm, pattern, quant, x, residual, weight, next_weight, eps, next_eps, weight_offset, scale=None,
        scale_floor=None, column_major_scales=False, return_normed=False, bias=None, next_bias=None,
        residual_scale=1.0):
    """Fp8Norm of `pattern` over comm's group with the FP8 epilogue `quant`
    (a tpcomm.fp8.Quant, its int or name); scale_floor None: the mode's
    default; bias, next_bias, residual_scale as tpcomm.norm_patterns.run
    takes them. Raises before anything collective for bad arguments or a
    closed Communicator."""
    vectors = (weight, next_weight, bias, next_bias)
    for tensor, what in zip((x, residual, *vectors, scale),
                            ("input", "residual", "weight", "next_weight", "bias", "next_bias", "scale")):
        if tensor is not None:
            comm._check_input(tensor, what)
    norm_patterns.check_args(pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset, bias, next_bias,
                             residual_scale)
    quant, floor = fp8.check_args(quant, x, scale, scale_floor, column_major_scales)
    pattern, residual_scale = Pattern(pattern), norm_patterns.fp32_scale(residual_scale)
    how = route(comm, pattern, x, weight, next_weight, weight_offset, bias, next_bias, residual_scale)
    args = (comm, how, pattern, quant, x, residual, vectors, eps, next_eps, weight_offset, residual_scale, scale,
            floor, bool(column_major_scales), bool(return_normed))
    if _autograd.needs_grad(*(t for t in (x, residual, *vectors, scale) if t is not None)):
        out = _autograd.without_backward(_run, STATS_KEY[pattern], *args)
    else:
        out = _run(*args)
    comm._count(STATS_KEY[pattern], how, x)
    return Fp8Norm(*out)


def _run(comm, how, pattern, quant, x, residual, vectors, eps, next_eps, weight_offset, residual_scale, scale, floor,
         column_major_scales, return_normed):
    """(codes, scales, stream, normed or None) by route `how`: every output
    contiguous but column-major scales. vectors: (weight, next_weight, bias,
    next_bias), each None where not given."""
    weight, next_weight, bias, next_bias = vectors
    xc, rc = x.contiguous(), residual.contiguous()
    if how == "fused":
        normed = torch.empty(xc.shape, dtype=xc.dtype, device=xc.device) if return_normed else None
        stream = torch.empty(rc.shape, dtype=rc.dtype, device=rc.device)
        codes, scales = fp8.empty_outputs(xc, quant, scale, column_major_scales)
        w, nw, b, nb = (None if v is None else v.contiguous() for v in vectors)
        comm.kernels.all_reduce_norm_quant(pattern, quant, xc, rc, w, nw, eps, next_eps, weight_offset, floor, normed,
                                           stream, codes, scales, b, nb, residual_scale=residual_scale)
        return codes, scales, stream, normed
    sums = add_rms_norm.uncounted(comm, "all_reduce", xc.float(), call=(STATS_KEY[pattern], x))
    normed, stream = norm_patterns.from_sums(pattern, sums, rc, weight, next_weight, eps, next_eps, weight_offset,
                                             x.dtype, bias, next_bias, residual_scale)
    codes, scales = fp8.quantize_checked(normed, quant, scale, floor, column_major_scales)
    return codes, scales, stream, normed if return_normed else None
