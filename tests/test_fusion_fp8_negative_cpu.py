"""What tpcomm.fusion_fp8 leaves alone, on 2 gloo ranks: a quantization
whose intermediate (the fp32 cast, |x|, the amax, the unfloored scale, the
division, the clamp, the group view) is read outside it, bounds other than
+-448, a static scale of more than one element, groups that are not 128
values of one row, e5m2, a floor of 0, a multiplication by the scale's
reciprocal (torchao's 448 / amax form among them: other bits than the
division the op computes), a floor that is 0 in fp32. Each model compiles, its graph holds the fused
norm but no all_reduce_norm_fp8, no "_fp8" count, and it gives the eager
reference's bits (the quantization's code on the eager fused norm's output,
as in tests/test_fusion_fp8_cpu.py)."""
import torch

import tpcomm
from tpcomm.fusion_fp8 import COUNT_KEY
from tpcomm.norm_patterns import STATS_KEY, Pattern

import fp8_models as M
from tpcomm import fusion, fusion_fp8
from fp8_models import F8
from multiproc import run_ranks
from norm_helpers import capture, copy_graph


def _sat(v, bound=448.0):
    return v.clamp(-bound, bound)


def _token_parts(n):
    f = n.float()
    amax = f.abs().amax(dim=-1, keepdim=True)
    unfloored = amax / 448
    scale = unfloored.clamp(min=1e-6)
    return f, amax, unfloored, scale


def cast_kept(n, s):
    f, _, _, scale = _token_parts(n)
    return _sat(f / scale).to(F8), scale, f


def abs_kept(n, s):
    f = n.float()
    a = f.abs()
    scale = (a.amax(dim=-1, keepdim=True) / 448).clamp(min=1e-6)
    return _sat(f / scale).to(F8), scale, a


def amax_kept(n, s):
    f, amax, _, scale = _token_parts(n)
    return _sat(f / scale).to(F8), scale, amax


def unfloored_kept(n, s):
    f, _, unfloored, scale = _token_parts(n)
    return _sat(f / scale).to(F8), scale, unfloored


def division_kept(n, s):
    f, _, _, scale = _token_parts(n)
    d = f / scale
    return _sat(d).to(F8), scale, d


def clamp_kept(n, s):
    f, _, _, scale = _token_parts(n)
    c = _sat(f / scale)
    return c.to(F8), scale, c


def static_clamp_kept(n, s):
    c = _sat(n.float() / s)
    return c.to(F8), None, c


def group_view_kept(n, s):
    g = n.float().view(-1, 128)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448
    return _sat(g / scale).to(F8), scale, g


def bounds_240(n, s):
    f, _, _, scale = _token_parts(n)
    return _sat(f / scale, 240.0).to(F8), scale


def one_sided(n, s):
    return (n.float() / s).clamp(max=448).to(F8), None


def e5m2(n, s):
    f, _, _, scale = _token_parts(n)
    return _sat(f / scale).to(torch.float8_e5m2), scale


def e5m2_bounds(n, s):
    return _sat(n.float() / s, 57344.0).to(torch.float8_e5m2), None


def floor_zero(n, s):
    f = n.float()
    scale = (f.abs().amax(dim=-1, keepdim=True) / 448).clamp(min=0.0)
    return _sat(f / scale).to(F8), scale


def floor_underflows(n, s):  # 1e-50 is 0 in fp32: torch floors at 0, the op takes floors > 0
    f = n.float()
    scale = torch.amax(f.abs(), -1, keepdim=True).clamp(min=1e-50) / 448
    return _sat(f / scale).to(F8), scale


def reciprocal(n, s):
    f, _, _, scale = _token_parts(n)
    return _sat(f * (1.0 / scale)).to(F8), scale


def torchao_form(n, s):  # torchao's float8 rowwise: the scale as 448 / amax, multiplied in
    f = n.float()
    inverse = 448.0 / f.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    return _sat(f * inverse).to(F8), inverse


def static_reciprocal(n, s):
    return _sat(n.float() * s.reciprocal()).to(F8), None


def groups_of_64(n, s):
    g = n.float().view(*n.shape[:-1], -1, 64)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448
    return _sat(g / scale).to(F8), scale


def rounding_mode(n, s):
    return _sat(torch.div(n.float(), s, rounding_mode="floor")).to(F8), None


NEGATIVE = {f.__name__: f for f in (
    cast_kept, abs_kept, amax_kept, unfloored_kept, division_kept, clamp_kept, static_clamp_kept, group_view_kept,
    bounds_240, one_sided, e5m2, e5m2_bounds, floor_zero, floor_underflows, reciprocal, torchao_form, static_reciprocal,
    groups_of_64, rounding_mode)}
WIDE = torch.full((M.HIDDEN,), 1 / 64)  # a static scale of HIDDEN elements (per channel)
GROUPS_ACROSS_ROWS = 320  # view(-1, 128) of rows of 320 values: groups cross rows


def _untouched(model, y, residual, what):
    out, backend, gm = M.compile_and_run(model, y, residual)
    graph = M.targets(gm)
    assert M.FP8_OP not in graph and any(t in M.NORM_OPS for t in graph), (what, graph)
    assert not any(backend.counts[k] for k in COUNT_KEY.values()), (what, backend.counts)
    assert backend.counts[STATS_KEY[model.pattern]] == model.layers, (what, backend.counts)
    with torch.no_grad():
        M.assert_same(out, model(y, residual, reference=True), what)


def _body(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    w1, w2 = M.weights(torch.bfloat16)
    y, residual = M.inputs(rank, torch.bfloat16)
    cases = [(name, quant, torch.tensor(1 / 64), M.HIDDEN) for name, quant in NEGATIVE.items()]
    cases += [("static scale of HIDDEN elements", M.static, WIDE, M.HIDDEN),
              ("view(-1, 128) across rows", M.group_rows, None, GROUPS_ACROSS_ROWS)]
    for name, quant, scale, hidden in cases:
        w1h, w2h = M.weights(torch.bfloat16, hidden)
        yh, rh = M.inputs(rank, torch.bfloat16, hidden=hidden)
        for pattern in (Pattern.ADD_NORM, Pattern.NORM_ADD):
            model = M.Layers(comm.group_name, pattern, "llama", quant, w1h, w2h, scale).eval()
            _untouched(model, yh, rh, f"{name} {pattern.name}")
    assert not any(key[0] in COUNT_KEY.values() for key in comm.stats()), comm.stats()
    comm.close()


def test_the_pass_leaves_these_alone():
    run_ranks(2, _body, timeout=600)


# ------------------------------------------------ every removed node, one more user
def _norm_outputs(gm):
    """The names of the fused-norm calls and their getitems: the op takes over their values."""
    calls = [n for n in gm.graph.nodes if n.target in M.NORM_OPS]
    return {n.name for n in calls} | {u.name for c in calls for u in c.users}


def _body_every_removed_node(rank, world_size):
    """Each node fusion_fp8 removes from a clean match, given one more user: an
    intermediate (every user of it inside the pattern) stops the rewrite and
    the graph stays exactly as it was; the codes (in groups too, before the
    view back to rows) and the scale (read outside already) take the op's
    outputs. The values are the graph's before."""
    comm = tpcomm.Communicator(device="cpu")
    w1, w2 = M.weights(torch.bfloat16)
    y, residual = M.inputs(rank, torch.bfloat16)
    for pattern in M.PATTERNS:
        for name, quant in M.QUANTS.items():
            model = M.Layers(comm.group_name, pattern, "llama", quant, w1, w2, torch.tensor(1 / 64), layers=1)
            gm, inputs = capture(model.eval(), y, residual)
            fusion.fuse(gm)
            clean = copy_graph(gm)
            assert fusion_fp8.fuse(clean)[COUNT_KEY[pattern]] == 1, (pattern, name)
            removed = {n.name for n in gm.graph.nodes} - {n.name for n in clean.graph.nodes} - _norm_outputs(gm)
            by_name = {n.name: n for n in gm.graph.nodes}
            assert removed, (pattern, name)
            for node in sorted(removed):
                what = f"{pattern.name} {name}: one more user of {node}"
                # the grouped codes viewed back to the rows are the op's codes in another view: never inside
                inside = all(u.name in removed for u in by_name[node].users) \
                    and getattr(by_name[node].meta["example_value"], "dtype", None) != F8
                variant = copy_graph(gm, extra=node)
                with torch.no_grad():
                    expected, code = variant(*inputs), variant.code
                    moved = fusion_fp8.fuse(variant)
                    variant.graph.lint()
                    got = variant(*inputs)
                assert moved[COUNT_KEY[pattern]] == (0 if inside else 1), (what, moved)
                if inside:
                    assert variant.code == code, what
                M.assert_same(_flat(got), _flat(expected), what)
    comm.close()


def _flat(outputs):
    """The tensors of outputs, a tuple output (the max node's values, indices) in its place."""
    return [t for o in outputs for t in (o if isinstance(o, tuple) else (o,))]


def test_a_removed_value_read_elsewhere_stops_the_rewrite():
    run_ranks(2, _body_every_removed_node, timeout=600)
