"""The models of the compile pass's fusion forms, shared by the CPU tests
(test_fusion_forms_cpu, test_parallel_merge_cpu) and the GPU one
(gpu/test_fusion_forms_gpu): the norms and residual forms model code writes
(LayerNorm, a residual multiplier, RMSNorm with the weight multiplied before
the cast) before and after the add, and the parallel block's two
all-reduces."""
import torch

from tpcomm.norm_patterns import STATS_KEY, Pattern

HIDDEN = 32
EPS = 1e-5


def layer_norm(kind, x, weight, bias):
    """A LayerNorm of x as model code writes it."""
    if kind == "module":  # nn.LayerNorm's call
        return torch.nn.functional.layer_norm(x, (HIDDEN,), weight, bias, EPS)
    if kind == "no_bias":
        return torch.nn.functional.layer_norm(x, (HIDDEN,), weight, None, EPS)
    if kind == "olmo":  # no weight, no bias, in fp32
        return torch.nn.functional.layer_norm(x.to(dtype=torch.float32), (HIDDEN,), None, None, eps=EPS).to(x.dtype)
    h = x.to(torch.float32)  # Cohere's
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(variance + EPS)
    return (weight.to(torch.float32) * h).to(x.dtype)


def rms_norm(kind, x, weight):
    """An RMSNorm of x with the weight in another place than Llama's."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    if kind == "weight_first":  # Granite-style rewrites, Cohere's order
        return (weight * h).to(x.dtype)
    if kind == "float_weight_first":
        return (h * weight.float()).to(x.dtype)
    return h.to(x.dtype) * weight  # Llama's product, the other order


def any_norm(kind, x, weight, bias):
    return rms_norm(kind, x, weight) if kind.endswith("weight_first") or kind == "cast_first" \
        else layer_norm(kind, x, weight, bias)


class Pre(torch.nn.Module):
    """norm(residual + all_reduce(y) [* m])."""

    def __init__(self, group, kind, w, b, m=None):
        super().__init__()
        self.group, self.kind, self.m = group, kind, m
        self.w, self.b = torch.nn.Parameter(w), torch.nn.Parameter(b)

    def forward(self, y, residual):
        s = torch.ops.tpcomm.custom_all_reduce(y, self.group)
        h = residual + (s if self.m is None else s * self.m)
        return any_norm(self.kind, h, self.w, self.b), h


class Post(Pre):
    """residual + norm(all_reduce(y)) [* m] [, then the next norm]."""

    def __init__(self, group, kind, w, b, m=None, then_norm=False):
        super().__init__(group, kind, w, b, m)
        self.then_norm = then_norm

    def forward(self, y, residual):
        n = any_norm(self.kind, torch.ops.tpcomm.custom_all_reduce(y, self.group), self.w, self.b)
        h = residual + (n if self.m is None else n * self.m)
        return (any_norm(self.kind, h, self.b, self.w), h) if self.then_norm else (h,)


LAYER = ("module", "no_bias", "olmo", "cohere")
RMS = ("weight_first", "float_weight_first", "cast_first")


def fused_cases(group, w, b):
    """(model, the stats key its one fused call counts under, dynamic): under dynamic=True Dynamo
    passes the multiplier and eps as 0-dim tensors read by .item(), symbolic floats (taken where
    the norm follows the add, as RMSNorm's eps: tpcomm.fusion)."""
    cases = []
    for kind in LAYER:
        cases += [(Pre(group, kind, w, b), STATS_KEY[Pattern.ADD_LAYER_NORM], None),
                  (Post(group, kind, w, b), STATS_KEY[Pattern.LAYER_NORM_ADD], None),
                  (Post(group, kind, w, b, then_norm=True), STATS_KEY[Pattern.LAYER_NORM_ADD_LAYER_NORM], None)]
    cases += [(Pre(group, kind, w, b), STATS_KEY[Pattern.ADD_NORM], None) for kind in RMS]
    # the residual multiplier: before the norm and after it, a Python number or a symbolic float
    cases += [(Pre(group, "weight_first", w, b, m=0.22), STATS_KEY[Pattern.ADD_NORM], None),
              (Pre(group, "module", w, b, m=3), STATS_KEY[Pattern.ADD_LAYER_NORM], None),
              (Post(group, "module", w, b, m=0.5, then_norm=True), STATS_KEY[Pattern.LAYER_NORM_ADD_LAYER_NORM], None),
              (Pre(group, "weight_first", w, b, m=0.22), STATS_KEY[Pattern.ADD_NORM], True),
              (Pre(group, "cohere", w, b, m=0.5), STATS_KEY[Pattern.ADD_LAYER_NORM], True),
              (Pre(group, "module", w, b, m=2.0), STATS_KEY[Pattern.ADD_LAYER_NORM], True)]
    return cases


class Parallel(torch.nn.Module):
    """attention and MLP partial sums y1, y2: (all_reduce(y1) + all_reduce(y2)) + residual
    (or residual + all_reduce(y1) first), then an RMSNorm."""

    def __init__(self, group, w, residual_first=False, keep=False, group2=None):
        super().__init__()
        self.group, self.group2 = group, group2 or group
        self.w, self.residual_first, self.keep = torch.nn.Parameter(w), residual_first, keep

    def forward(self, y1, y2, residual):
        a = torch.nn.functional.dropout(torch.ops.tpcomm.custom_all_reduce(y1, self.group), 0.0, False)
        m = torch.ops.tpcomm.custom_all_reduce(y2, self.group2)
        z = (residual + a) + m if self.residual_first else (a + m) + residual
        out = torch.nn.functional.rms_norm(z, (HIDDEN,), self.w, 1e-6), z
        return out + (a,) if self.keep else out
