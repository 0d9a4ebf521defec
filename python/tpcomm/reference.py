"""The numerics the fused all-reduce + residual add + RMSNorm is held to, in
plain torch: what tests on the CPU and on GPUs compare with.

rank_order_sum is every reducing kernel's sum: the ranks' inputs in fp32, in
rank order 0..n-1, from -0.0 (as the kernels start), not rounded.
reference_add_rms_norm takes every rank's input, adds the residual to that
sum, and normalises over the last dimension, rounding once at the end.
ulp_distance measures how far apart two 16-bit or 32-bit float tensors are,
in units in the last place of their dtype (0 where the bits are equal).
reference_all_reduce_norm does the same for every fusion pattern of
tpcomm.norm_patterns (the sandwich norm of Gemma among them)."""
import torch


def rank_order_sum(inputs):
    """(((-0 + x_0) + x_1) + ...) in fp32, not rounded."""
    total = torch.full_like(inputs[0], -0.0, dtype=torch.float32)
    for x in inputs:
        total = total + x.float()
    return total


def reference_add_rms_norm(inputs, residual, weight, eps):
    """(normed, residual_out) of the fused op for the ranks' `inputs`, in
    their dtype: z = (((-0 + x_0) + x_1) + ...) + residual in fp32,
    residual_out = z rounded, normed = z * rsqrt(mean(z^2) + eps) * weight
    rounded."""
    z = rank_order_sum(inputs) + residual.float()
    normed = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(inputs[0].dtype), z.to(inputs[0].dtype)


def reference_all_reduce_norm(inputs, residual, weight, eps, pattern, weight_offset=0.0, next_weight=None,
                              next_eps=None, bias=None, next_bias=None, residual_scale=1.0):
    """(normed, stream) of tpcomm.norm_patterns' `pattern` for the ranks'
    `inputs`, in their dtype: s = (((-0 + x_0) + x_1) + ...) in fp32, m =
    residual_scale rounded to fp32, w' = w + offset, then
      ADD_NORM        z = r + m*s, (z * rsqrt(mean(z^2) + eps) * w', z)
      NORM_ADD        o = r + m*(s * rsqrt(mean(s^2) + eps) * w'), (o, o)
      NORM_ADD_NORM   o as NORM_ADD, (o * rsqrt(mean(o^2) + next_eps) * (next_w + offset), o)
    and with ln(v) = (v - mean(v)) * rsqrt(mean((v - mean(v))^2) + eps) [* w'] [+ b]
      ADD_LAYER_NORM  z = r + m*s, (ln(z), z)
      LAYER_NORM_ADD  o = r + m*ln(s), (o, o)
      LAYER_NORM_ADD_LAYER_NORM  o as LAYER_NORM_ADD, (ln(o) with next_w, next_b, next_eps, o)
    all in fp32, each output rounded once. Written out here, not taken from
    tpcomm.norm_patterns, so the tests hold the op to an independent text."""
    s = rank_order_sum(inputs)
    r = residual.float()
    dtype = inputs[0].dtype
    m = float(torch.tensor(float(residual_scale), dtype=torch.float32))
    pattern = int(pattern)
    layer = pattern >= 3

    def scaled(w):  # offset 0 adds nothing: +0 would turn a weight of -0.0 into +0.0
        return w.float() + weight_offset if weight_offset else w.float()

    def norm(v, w, b, e):
        if not layer:
            return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + e) * scaled(w)
        d = v - v.mean(-1, keepdim=True)
        y = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + e)
        y = y if w is None else y * scaled(w)
        return y if b is None else y + b.float()

    if pattern in (0, 3):
        z = r + m * s
        return norm(z, weight, bias, eps).to(dtype), z.to(dtype)
    o = r + m * norm(s, weight, bias, eps)
    if pattern in (1, 4):
        return o.to(dtype), o.to(dtype)
    return norm(o, next_weight, next_bias, next_eps).to(dtype), o.to(dtype)


_INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def ulp_distance(a, b):
    """Per element, how many representable values of the dtype lie between
    a and b (0: the same bits, -0.0 and +0.0 count as 1 apart). NaNs must
    match by position; their distance is 0."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"ulp_distance of {a.dtype}{tuple(a.shape)} and {b.dtype}{tuple(b.shape)}")
    bits = 8 * a.element_size()
    sign = 1 << (bits - 1)

    def ordered(t):  # the bit patterns mapped to integers in the order of the values
        i = t.contiguous().view(_INT_OF[t.dtype]).to(torch.int64) & ((1 << bits) - 1)
        return torch.where(i >= sign, sign - 1 - i, i)

    nan = torch.isnan(a) | torch.isnan(b)
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        raise AssertionError("NaNs at different positions")
    return torch.where(nan, torch.zeros_like(ordered(a)), (ordered(a) - ordered(b)).abs())
