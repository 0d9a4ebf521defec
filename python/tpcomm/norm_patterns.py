"""The fusion patterns of an all-reduce with the residual add and a norm
(RMSNorm or LayerNorm) around it, as one enum: what tpcomm.fusion matches in
a graph and the private op torch.ops._tpcomm.all_reduce_norm computes. With
s = all_reduce(y) (the ranks' inputs summed in fp32, in rank order), the
residual scale m (a finite float, 1.0 by default), w' = w + weight_offset,
  norm_w(v)  = v * rsqrt(mean(v^2, -1) + eps) * w'                     (RMSNorm)
  ln_w,b(v)  = (v - mean(v)) * rsqrt(mean((v - mean(v))^2) + eps) * w' + b
               (LayerNorm, biased variance as torch.layer_norm; no weight:
               no multiply, no bias: no add)

  ADD_NORM          z = r + m*s;          returns (norm_w(z), z)
                    (Llama, Mistral, Qwen, Phi-3, Mixtral: the pre-norm layer)
  NORM_ADD          o = r + m*norm_w(s);  returns (o, o)
  NORM_ADD_NORM     o as NORM_ADD;        returns (norm_w2(o), o)
                    (Gemma 2/3: the "sandwich" norm on the sub-layer's output,
                    then the next sub-layer's pre-norm with its own weight)
  ADD_LAYER_NORM    z = r + m*s;          returns (ln_w,b(z), z)
  LAYER_NORM_ADD    o = r + m*ln_w,b(s);  returns (o, o)
  LAYER_NORM_ADD_LAYER_NORM  o as LAYER_NORM_ADD; returns (ln_w2,b2(o), o)

weight_offset is 0 (weight w) or 1 (weight 1 + w, Gemma's convention); it
applies to every norm of the call. The RMS patterns take a weight and no
bias; the LayerNorm patterns an optional weight (none: weight_offset 0) and
an optional bias, and the next norm's own (next_weight, next_bias). Every
intermediate (s, z, o, the norms) stays in fp32 and each output is rounded
once to the input's dtype, so the result depends only on the ranks' inputs:
the same bits on every rank. tpcomm.reference.reference_all_reduce_norm is
the definition the tests hold the op to. Pattern is csrc/tpcomm.h's
tpc_norm_pattern.

Every pattern runs in one launch of the fused kernel family
(csrc/kernels/all_reduce_norm.cuh, route "fused") where ADD_NORM would:
fp16/bf16, every weight of the input's dtype, the input within the packet
cap and the routing table's fused_norm_max_bytes, a row of at most TPC_NORM_MAX_ROW_BYTES,
Config.fused_kernel on (tpcomm.routing.norm_pattern decides). Its stream
output is the reference bit for bit for ADD_NORM and ADD_LAYER_NORM and
within 1 ulp for the others (o takes the norm of s, whose sums the kernel
takes in another order), its normed output within 1 ulp (a LayerNorm's
plus the fp32 bound of its sums' order, docs/design.md). ADD_NORM with weight_offset
0 and m = 1 is Communicator.all_reduce_add_rms_norm, whose "split" route
also takes prefill sizes. Anything else runs "unfused": the all-reduce in
fp32 through the Communicator's route (uncounted: the call counts once,
under the pattern's key) and the rest in torch, in fp32.
"""
import enum
import math

import torch

from . import _constants as C
from . import add_rms_norm, routing


class Pattern(enum.IntEnum):
    ADD_NORM = C.TPC_PATTERN_ADD_NORM
    NORM_ADD = C.TPC_PATTERN_NORM_ADD
    NORM_ADD_NORM = C.TPC_PATTERN_NORM_ADD_NORM
    ADD_LAYER_NORM = C.TPC_PATTERN_ADD_LAYER_NORM
    LAYER_NORM_ADD = C.TPC_PATTERN_LAYER_NORM_ADD
    LAYER_NORM_ADD_LAYER_NORM = C.TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM


LAYER_NORM = frozenset({Pattern.ADD_LAYER_NORM, Pattern.LAYER_NORM_ADD, Pattern.LAYER_NORM_ADD_LAYER_NORM})
ADD_FIRST = frozenset({Pattern.ADD_NORM, Pattern.ADD_LAYER_NORM})  # normed = norm(r + m*s)
NEXT_NORM = frozenset({Pattern.NORM_ADD_NORM, Pattern.LAYER_NORM_ADD_LAYER_NORM})  # a second norm, of o

# The key each pattern's calls count under in Communicator.stats()
STATS_KEY = {Pattern.ADD_NORM: "all_reduce_add_rms_norm",
             Pattern.NORM_ADD: "all_reduce_rms_norm_add",
             Pattern.NORM_ADD_NORM: "all_reduce_rms_norm_add_rms_norm",
             Pattern.ADD_LAYER_NORM: "all_reduce_add_layer_norm",
             Pattern.LAYER_NORM_ADD: "all_reduce_layer_norm_add",
             Pattern.LAYER_NORM_ADD_LAYER_NORM: "all_reduce_layer_norm_add_layer_norm"}


def _weight(weight, weight_offset):
    """w + offset in fp32; offset 0 adds nothing (+0 would turn a weight of -0.0 into +0.0)."""
    return weight.float() + weight_offset if weight_offset else weight.float()


def rms_norm(v, weight, eps, weight_offset):
    """v * rsqrt(mean(v^2) + eps) * (weight + weight_offset), v in fp32, not rounded."""
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * _weight(weight, weight_offset)


def layer_norm(v, weight, bias, eps, weight_offset):
    """(v - mean(v)) * rsqrt(mean((v - mean(v))^2) + eps) [* (weight + weight_offset)] [+ bias],
    v in fp32, not rounded, in that order of operations."""
    d = v - v.mean(-1, keepdim=True)
    y = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * _weight(weight, weight_offset)
    return y if bias is None else y + bias.float()


def fp32_scale(residual_scale):
    """m as the kernel takes it: the float rounded to fp32 (a Python float)."""
    return float(torch.tensor(float(residual_scale), dtype=torch.float32))


def from_sums(pattern, sums, residual, weight, next_weight, eps, next_eps, weight_offset, dtype, bias=None,
              next_bias=None, residual_scale=1.0):
    """(normed, stream) of `pattern` from the fp32 sums, rounded once to dtype."""
    pattern = Pattern(pattern)
    if pattern in LAYER_NORM:
        def norm(v, w, b, e):
            return layer_norm(v, w, b, e, weight_offset)
    else:
        def norm(v, w, b, e):
            return rms_norm(v, w, e, weight_offset)
    r, m = residual.float(), fp32_scale(residual_scale)
    if pattern in ADD_FIRST:
        z = r + m * sums  # m = 1 multiplies exactly: today's bits
        return norm(z, weight, bias, eps).to(dtype), z.to(dtype)
    o = r + m * norm(sums, weight, bias, eps)
    if pattern in NEXT_NORM:
        return norm(o, next_weight, next_bias, next_eps).to(dtype), o.to(dtype)
    return o.to(dtype), o.to(dtype, copy=True)  # two outputs, never one tensor twice


def _stand_in(x):
    """A weight that passes add_rms_norm.check_args (no memory): where a norm has none."""
    return torch.empty(x.shape[-1:], dtype=x.dtype if x.is_floating_point() else torch.float32, device="meta")


def _check_vector(x, v, what):
    if v is not None and (v.shape != x.shape[-1:] or not v.is_floating_point()):
        raise ValueError(f"tpcomm: {what} must be a floating-point vector of the input's last dimension "
                         f"{tuple(x.shape[-1:])}; got {v.dtype}{tuple(v.shape)}")


def check_args(pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset, bias=None, next_bias=None,
               residual_scale=1.0):
    """Every rule of the call's arguments; raises before anything collective happens."""
    if pattern not in Pattern.__members__.values():
        raise ValueError(f"tpcomm: unknown fusion pattern {pattern!r}; one of {[int(p) for p in Pattern]}")
    pattern = Pattern(pattern)
    layer = pattern in LAYER_NORM
    if weight is None and not layer:
        raise ValueError(f"tpcomm: pattern {pattern.name} (an RMSNorm) takes a weight")
    add_rms_norm.check_args(x, residual, _stand_in(x) if weight is None else weight, eps)
    second = pattern in NEXT_NORM
    if next_weight is not None and not second or next_weight is None and pattern == Pattern.NORM_ADD_NORM:
        raise ValueError(f"tpcomm: pattern {pattern.name} takes {'a' if second else 'no'} next_weight")
    if next_bias is not None and not second:
        raise ValueError(f"tpcomm: pattern {pattern.name} takes no next_bias")
    if not layer and (bias is not None or next_bias is not None):
        raise ValueError(f"tpcomm: pattern {pattern.name} is an RMSNorm: it takes no bias (a LayerNorm pattern does)")
    for v, what in ((weight, "weight"), (bias, "bias"), (next_weight, "next_weight"), (next_bias, "next_bias")):
        _check_vector(x, v, what)
    if second:
        add_rms_norm.check_args(x, residual, _stand_in(x), next_eps)
    if weight_offset not in (0.0, 1.0):
        raise ValueError(f"tpcomm: weight_offset={weight_offset!r} must be 0 (weight w) or 1 (weight 1 + w)")
    if weight_offset and (weight is None or second and next_weight is None):
        raise ValueError(f"tpcomm: weight_offset={weight_offset!r} needs every norm's weight (w + offset); "
                         "a LayerNorm without weight takes weight_offset 0")
    if not (isinstance(residual_scale, (int, float)) and math.isfinite(residual_scale)
            and math.isfinite(fp32_scale(residual_scale))):
        raise ValueError(f"tpcomm: residual_scale={residual_scale!r} must be a finite number (in fp32)")


def route(comm, pattern, x, weight, next_weight, weight_offset, bias=None, next_bias=None, residual_scale=1.0):
    """How run() takes this call: "fused", "unfused", or (ADD_NORM with
    weight w and m = 1) any route of Communicator.all_reduce_add_rms_norm."""
    add_norm = comm.route_all_reduce_add_rms_norm(x, x if weight is None else weight)
    dtypes = (None if v is None else v.dtype for v in (next_weight, bias, next_bias))
    return routing.norm_pattern(add_norm, pattern, weight_offset, x.dtype, *dtypes, residual_scale=residual_scale)


def run(comm, pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset, bias=None, next_bias=None,
        residual_scale=1.0):
    """(normed, stream) of `pattern` over comm's group (see the module's doc);
    counted once in comm.stats() under STATS_KEY[pattern] and the route that ran."""
    check_args(pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset, bias, next_bias,
               residual_scale)
    pattern, residual_scale = Pattern(pattern), fp32_scale(residual_scale)
    if pattern == Pattern.ADD_NORM and not weight_offset and residual_scale == 1.0:
        return comm.all_reduce_add_rms_norm(x, residual, weight, eps)
    comm._check_open()  # a closed Communicator holds no fallback
    how = route(comm, pattern, x, weight, next_weight, weight_offset, bias, next_bias, residual_scale)
    if how == "fused":
        xc, rc = x.contiguous(), residual.contiguous()
        normed, stream = torch.empty_like(xc), torch.empty_like(rc)
        comm.kernels.all_reduce_norm(pattern, xc, rc, *_contiguous(weight, next_weight), eps, next_eps,
                                     weight_offset, normed, stream, *_contiguous(bias, next_bias),
                                     residual_scale=residual_scale)
    else:
        sums = add_rms_norm.uncounted(comm, "all_reduce", x.float(), call=(STATS_KEY[pattern], x))
        normed, stream = from_sums(pattern, sums, residual, weight, next_weight, eps, next_eps, weight_offset,
                                   x.dtype, bias, next_bias, residual_scale)
    comm._count(STATS_KEY[pattern], how, x)
    return normed, stream


def _contiguous(*vectors):
    return tuple(None if v is None else v.contiguous() for v in vectors)
