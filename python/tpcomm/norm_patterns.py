"""The fusion patterns of an all-reduce with the residual add and RMSNorm
around it, as one enum: what tpcomm.fusion matches in a graph and the
private op torch.ops._tpcomm.all_reduce_norm computes. With
s = all_reduce(y) (the ranks' inputs summed in fp32, in rank order),
norm_w(v) = v * rsqrt(mean(v^2, -1) + eps) * (w + weight_offset):

  ADD_NORM          z = s + r;            returns (norm_w(z), z)
                    (Llama, Mistral, Qwen, Phi-3, Mixtral: the pre-norm layer)
  NORM_ADD          o = r + norm_w(s);    returns (o, o)
  NORM_ADD_NORM     o = r + norm_w(s);    returns (norm_w2(o), o)
                    (Gemma 2/3: the "sandwich" norm on the sub-layer's output,
                    then the next sub-layer's pre-norm with its own weight)

weight_offset is 0 (weight w) or 1 (weight 1 + w, Gemma's convention); it
applies to every norm of the call. Every intermediate (s, z, o, the norms)
stays in fp32 and each output is rounded once to the input's dtype, so the
result depends only on the ranks' inputs: the same bits on every rank.
tpcomm.reference.reference_all_reduce_norm is the definition the tests hold
the op to. Pattern is csrc/tpcomm.h's tpc_norm_pattern.

Every pattern and offset runs in one launch of the fused kernel family
(csrc/kernels/all_reduce_norm.cuh, route "fused") where ADD_NORM would:
fp16/bf16, every weight of the input's dtype, the input within the packet
cap, a row of at most TPC_NORM_MAX_ROW_BYTES, Config.fused_kernel on
(tpcomm.routing.norm_pattern decides). Its stream output is the reference
bit for bit for ADD_NORM and within 1 ulp for the others (o takes the norm
of s, whose mean of squares the kernel sums in another order), its normed
output within 1 ulp. ADD_NORM with weight_offset 0 is
Communicator.all_reduce_add_rms_norm, whose "split" route also takes
prefill sizes. Anything else runs "unfused": the all-reduce in fp32 through
the Communicator's route (uncounted: the call counts once, under the
pattern's key) and the rest in torch, in fp32.
"""
import enum

import torch

from . import _constants as C
from . import add_rms_norm, routing


class Pattern(enum.IntEnum):
    ADD_NORM = C.TPC_PATTERN_ADD_NORM
    NORM_ADD = C.TPC_PATTERN_NORM_ADD
    NORM_ADD_NORM = C.TPC_PATTERN_NORM_ADD_NORM


# The key each pattern's calls count under in Communicator.stats()
STATS_KEY = {Pattern.ADD_NORM: "all_reduce_add_rms_norm",
             Pattern.NORM_ADD: "all_reduce_rms_norm_add",
             Pattern.NORM_ADD_NORM: "all_reduce_rms_norm_add_rms_norm"}


def rms_norm(v, weight, eps, weight_offset):
    """v * rsqrt(mean(v^2) + eps) * (weight + weight_offset), v in fp32, not rounded."""
    w = weight.float() + weight_offset if weight_offset else weight.float()
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w


def from_sums(pattern, sums, residual, weight, next_weight, eps, next_eps, weight_offset, dtype):
    """(normed, stream) of `pattern` from the fp32 sums, rounded once to dtype."""
    r = residual.float()
    if pattern == Pattern.ADD_NORM:
        z = sums + r
        return rms_norm(z, weight, eps, weight_offset).to(dtype), z.to(dtype)
    o = r + rms_norm(sums, weight, eps, weight_offset)
    if pattern == Pattern.NORM_ADD:
        return o.to(dtype), o.to(dtype, copy=True)  # two outputs, never one tensor twice
    return rms_norm(o, next_weight, next_eps, weight_offset).to(dtype), o.to(dtype)


def check_args(pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset):
    add_rms_norm.check_args(x, residual, weight, eps)
    if pattern not in Pattern.__members__.values():
        raise ValueError(f"tpcomm: unknown fusion pattern {pattern!r}; one of {[int(p) for p in Pattern]}")
    if (next_weight is not None) != (pattern == Pattern.NORM_ADD_NORM):
        raise ValueError(f"tpcomm: pattern {Pattern(pattern).name} takes "
                         f"{'a' if pattern == Pattern.NORM_ADD_NORM else 'no'} next_weight")
    if next_weight is not None:
        add_rms_norm.check_args(x, residual, next_weight, next_eps)
    if weight_offset not in (0.0, 1.0):
        raise ValueError(f"tpcomm: weight_offset={weight_offset!r} must be 0 (weight w) or 1 (weight 1 + w)")


def route(comm, pattern, x, weight, next_weight, weight_offset):
    """How run() takes this call: "fused", "unfused", or (ADD_NORM with
    weight w) any route of Communicator.all_reduce_add_rms_norm."""
    return routing.norm_pattern(comm.route_all_reduce_add_rms_norm(x, weight), pattern, weight_offset, x.dtype,
                                None if next_weight is None else next_weight.dtype)


def run(comm, pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset):
    """(normed, stream) of `pattern` over comm's group (see the module's doc);
    counted once in comm.stats() under STATS_KEY[pattern] and the route that ran."""
    check_args(pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset)
    pattern = Pattern(pattern)
    if pattern == Pattern.ADD_NORM and not weight_offset:
        return comm.all_reduce_add_rms_norm(x, residual, weight, eps)
    comm._check_open()  # a closed Communicator holds no fallback
    how = route(comm, pattern, x, weight, next_weight, weight_offset)
    if how == "fused":
        xc, rc = x.contiguous(), residual.contiguous()
        normed, stream = torch.empty_like(xc), torch.empty_like(rc)
        comm.kernels.all_reduce_norm(pattern, xc, rc, weight.contiguous(),
                                     None if next_weight is None else next_weight.contiguous(), eps, next_eps,
                                     weight_offset, normed, stream)
    else:
        sums = add_rms_norm.uncounted(comm, "all_reduce", x.float(), call=(STATS_KEY[pattern], x))
        normed, stream = from_sums(pattern, sums, residual, weight, next_weight, eps, next_eps, weight_offset,
                                   x.dtype)
    comm._count(STATS_KEY[pattern], how, x)
    return normed, stream
