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
the op to.

ADD_NORM with weight_offset 0 is Communicator.all_reduce_add_rms_norm (its
routes: the fused kernel, split, unfused). The others run the all-reduce in
fp32 through the Communicator's route (uncounted: the call counts once,
under the pattern's key) and the rest in torch, in fp32.
"""
import enum

import torch

from . import add_rms_norm


class Pattern(enum.IntEnum):
    ADD_NORM = 0
    NORM_ADD = 1
    NORM_ADD_NORM = 2


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


def run(comm, pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset):
    """(normed, stream) of `pattern` over comm's group (see the module's doc);
    counted once in comm.stats() under STATS_KEY[pattern]."""
    check_args(pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset)
    pattern = Pattern(pattern)
    if pattern == Pattern.ADD_NORM and not weight_offset:
        return comm.all_reduce_add_rms_norm(x, residual, weight, eps)
    cell = comm._cell(STATS_KEY[pattern], "unfused")
    cell[0] += 1
    cell[1] += x.numel() * x.element_size()
    sums = add_rms_norm.uncounted(comm, "all_reduce", x.float())
    return from_sums(pattern, sums, residual, weight, next_weight, eps, next_eps, weight_offset, x.dtype)
