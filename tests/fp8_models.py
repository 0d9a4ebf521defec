"""Models of the FP8 compile-pass tests (tests/test_fusion_fp8_cpu.py,
tests/test_fusion_fp8_negative_cpu.py): layers of all-reduce + residual add +
RMSNorm (every pattern tpcomm.fusion knows, every spelling of the norm) whose
normed output is quantized to FP8 e4m3 by model code, in each form
tpcomm.fusion_fp8 matches (QUANTS) and in forms it must leave alone; and
check_tp_fp8, the check of examples/tp_fp8.py's compiled runs that
tests/test_tp_fp8_cpu.py and tests/gpu/test_fp8_model_gpu.py share. A helper
module, not a test module."""
import torch

import tpcomm
from tpcomm.fusion_fp8 import COUNT_KEY
from tpcomm.norm_patterns import LAYER_NORM, STATS_KEY, Pattern

from norm_helpers import norm

F8 = torch.float8_e4m3fn
HIDDEN = 256
EPS = 1e-6  # the fused op's eps, norm_helpers.norm's default too
PATTERNS = tuple(p for p in Pattern if p not in LAYER_NORM)  # the patterns of these models' RMSNorms


# ------------------------------------------------------ quantizations matched
def static(n, s):
    return (n.to(torch.float32) / s).clamp(-448, 448).to(F8), None


def static_div_finfo(n, s):
    return torch.clamp(torch.div(n.float(), s), min=torch.finfo(F8).min, max=torch.finfo(F8).max).to(F8), None


def token(n, s):
    f = n.float()
    scale = (f.abs().amax(dim=-1, keepdim=True) / 448).clamp(min=1 / (448 * 512))
    return (f / scale).clamp(-448, 448).to(F8), scale


def token_vllm(n, s):  # vLLM / DeepSeek: the floor on the amax, then / 448
    f = n.to(dtype=torch.float32)
    scale = torch.amax(torch.abs(f), -1, True).clamp(min=1e-10) / 448.0
    return torch.clamp(f / scale, -448.0, 448.0).to(F8), scale


def token_max(n, s):
    f = n.float()
    scale = torch.clamp(f.abs().max(dim=-1, keepdim=True).values / 448.0, min=1e-6)
    return (f / scale).clamp(min=-448, max=448).to(F8), scale


def group(n, s):  # viewed back to n's shape
    f = n.float()
    g = f.view(*f.shape[:-1], -1, 128)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448
    return (g / scale).clamp(-448, 448).to(F8).view(f.shape), scale


def group_reshape(n, s):  # codes left in groups, the scales squeezed
    f = n.float()
    hidden = f.shape[-1]
    g = f.reshape(*f.shape[:-1], hidden // 128, 128)
    scale = (g.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-3)
    return (g / scale).clamp(-448, 448).to(F8), scale.squeeze(-1)


def group_rows(n, s):  # view(-1, 128): one row per group
    f = n.float()
    g = f.view(-1, 128)
    scale = torch.amax(g.abs(), dim=-1, keepdim=True).clamp(min=1e-10) / 448.0
    return (g / scale).clamp(-448, 448).to(F8).view(n.shape), scale


QUANTS = {"static": static, "static_div_finfo": static_div_finfo, "token": token, "token_vllm": token_vllm,
          "token_max": token_max, "group": group, "group_reshape": group_reshape, "group_rows": group_rows}
CORE = ("static", "token", "group")  # the modes every pattern and spelling is compiled with


class Layers(torch.nn.Module):
    """`layers` layers of `pattern` with norm `kind`, each quantizing its
    normed output by `quant` (n, scale) -> (codes, scales or None, more
    tensors to return);
    keep_normed also returns the normed output. reference=True computes
    each layer's norm with torch.ops._tpcomm.all_reduce_norm (eager: fp32 from
    the sum to the norm, rounded once, as the FP8 op does) in place of the
    model's code."""

    def __init__(self, group_name, pattern, kind, quant, w1, w2, scale, layers=2, keep_normed=False):
        super().__init__()
        self.group, self.pattern, self.kind, self.quant = group_name, pattern, kind, quant
        self.w1, self.w2 = torch.nn.Parameter(w1, requires_grad=False), torch.nn.Parameter(w2, requires_grad=False)
        self.register_buffer("scale", scale)
        self.layers, self.keep_normed = layers, keep_normed

    def block(self, y, residual):
        """(normed, stream) as model code writes the pattern."""
        if self.pattern == Pattern.ADD_NORM:
            h = residual + torch.ops.tpcomm.custom_all_reduce(y, self.group)
            return norm(self.kind, h, self.w1), h
        h = residual + norm(self.kind, torch.ops.tpcomm.custom_all_reduce(y, self.group), self.w1)
        return (h, h) if self.pattern == Pattern.NORM_ADD else (norm(self.kind, h, self.w2), h)

    def fused(self, y, residual):
        nw = self.w2 if self.pattern == Pattern.NORM_ADD_NORM else None
        offset = 1.0 if self.kind == "gemma" else 0.0
        return torch.ops._tpcomm.all_reduce_norm(y, residual, self.w1, nw, EPS, EPS, offset, int(self.pattern),
                                                 self.group)

    def forward(self, y, residual, reference: bool = False):
        out = []
        for _ in range(self.layers):
            normed, residual = (self.fused if reference else self.block)(y, residual)
            quantized = self.quant(normed, self.scale)  # (codes, scales or None, anything else a test returns)
            out += [t for t in quantized if t is not None] + [residual] + ([normed] if self.keep_normed else [])
            y = y * 0.5  # the next layer's partial sums
        return tuple(out)


def inputs(rank, dtype, rows=6, hidden=HIDDEN):
    """(y, residual): y this rank's partial sums, with one row of NaN (rank 0),
    one of zeros and one large enough to saturate a static scale of 1/64."""
    g = torch.Generator().manual_seed(100 + rank)
    y = torch.randn(rows, hidden, generator=g).to(dtype)
    y[1] = 0
    y[2] *= 8
    if rank == 0:
        y[3, 5] = float("nan")
    residual = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7)).to(dtype)
    residual[1] = 0
    return y, residual


def weights(dtype, hidden=HIDDEN):
    g = torch.Generator().manual_seed(3)
    return torch.randn(hidden, generator=g).to(dtype), torch.randn(hidden, generator=g).to(dtype)


def assert_same(got, want, what):
    """Every output bit for bit, NaN compared by position (codes as uint8:
    torch keeps a NaN's sign where the kernel writes 0x7f; a NaN scale's sign
    depends on which NaN an amax met first)."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, i, g.shape, w.shape, g.dtype, w.dtype)
        nan = g.float().isnan()
        assert torch.equal(nan, w.float().isnan()), f"{what}: output {i}: NaN positions"
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()]
        assert torch.equal(g.contiguous().view(bits)[~nan], w.contiguous().view(bits)[~nan]), f"{what}: output {i}"


def compile_and_run(model, *args, inner="aot_eager"):
    """(outputs, the tpcomm backend, the Dynamo graph after tpcomm's pass) of
    model compiled with tpcomm.compile_backend(inner), fullgraph."""
    backend, seen = tpcomm.compile_backend(inner), []

    def spy(gm, example_inputs):
        compiled = backend(gm, example_inputs)  # rewrites gm's graph in place first
        seen.append(gm)
        return compiled

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=spy, fullgraph=True)(*args)
    assert len(seen) == 1
    return out, backend, seen[0]


FP8_OP = torch.ops._tpcomm.all_reduce_norm_fp8.default
NORM_OPS = (torch.ops._tpcomm.all_reduce_norm.default, torch.ops.tpcomm.custom_all_reduce_add_rms_norm.default)


def targets(gm):
    """The call targets of gm's graph, methods by name."""
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


TP_FP8_KEY = COUNT_KEY[Pattern.ADD_NORM]  # tp_fp8: residual + all_reduce(y), then the norm


def check_tp_fp8(result, issued, what, fp8_route, all_reduce_routes):
    """One compiled_fused run of examples/tp_fp8.py (tp_functional.run_modes'
    result): the compile pass fused every all-reduce + add + norm +
    quantization, all under the _fp8 key (none left a fused norm without its
    quantization, no other pattern), the head's all-reduce the only
    collective left (issued: tp_fp8.collectives()); stats() counted each FP8
    call on `fp8_route` and each all-reduce left on one of `all_reduce_routes`."""
    counts, calls = result["rewrites"], result["calls"]
    norm_key = STATS_KEY[Pattern.ADD_NORM]
    assert counts[TP_FP8_KEY] == issued["fused_fp8"], (what, counts)
    assert counts[norm_key] == 0 and counts["all_reduce"] == issued["all_reduce"], (what, counts)
    assert not [k for k, n in counts.items() if n and k not in (TP_FP8_KEY, norm_key, "all_reduce")], (what, counts)
    assert calls.get(f"{TP_FP8_KEY}/{fp8_route}") == issued["fused_fp8"], (what, calls)
    left = {k: n for k, n in calls.items() if k.split("/")[0] == "all_reduce"}
    assert sum(left.values()) == issued["all_reduce"] - issued["fused_fp8"], (what, calls)
    assert all(k.split("/")[1] in all_reduce_routes for k in left), (what, calls)
    assert set(calls) == {f"{TP_FP8_KEY}/{fp8_route}", *left}, (what, calls)
