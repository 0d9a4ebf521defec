"""The FP8 step of tpcomm's compile pass (issue 48): after tpcomm.fusion has
put an all-reduce with its residual add and RMSNorm into one fused call
(custom_all_reduce_add_rms_norm or _tpcomm.all_reduce_norm, any pattern of
tpcomm.norm_patterns), the quantization of its normed output to
torch.float8_e4m3fn that model code writes next joins that call:

    codes, scales, stream, normed = torch.ops._tpcomm.all_reduce_norm_fp8(...)

The op quantizes the normed output rounded to the model's dtype, as the
fused norm writes it, by tpcomm.fp8's math (spec/fp8.md), which is what the
code below computes from that output, bit for bit: the codes node takes the
op's codes, the scale node (dynamic modes) its scales (viewed where the graph
holds them in another shape), the stream output's users its stream, and the
normed output's other users, if any, its normed output (return_normed=True;
else the op does not write it). Matched, on the graph Dynamo captures, with
n the fused call's normed output:

    f = n.float() | n.to(torch.float32) | n.to(dtype=torch.float32)   (or n itself, fp32)
    q = sat(f / s).to(torch.float8_e4m3fn)
        sat(v): v.clamp(-448, 448), v.clamp(min=-448, max=448), torch.clamp(v, ...),
                torch.clip / .clip, the bounds written or torch.finfo(torch.float8_e4m3fn).min/max
        f / s:  operator.truediv, torch.div / torch.true_divide / .div without rounding_mode

  PER_TENSOR       s a graph tensor (an input or attribute) of one fp32 element
  PER_TOKEN        a = f.abs().amax(dim=-1, keepdim=True)   (torch.abs, torch.amax,
                       .max(dim=-1, keepdim=True).values, dim=-1 or the last index)
                   s = (a / 448).clamp(min=floor)   -> floor
                   s = a.clamp(min=eps) / 448       -> floor = fp32(eps) / 448 in fp32 (vLLM,
                       DeepSeek: the same bits, division by 448 being monotonic)
  PER_TOKEN_GROUP  the same on g = f.view(..., -1, 128), f.reshape(*shape[:-1], H // 128, 128)
                   or f.view(-1, 128) (H a multiple of 128); q then viewed back to n's
                   shape or not (the op's codes are then viewed as the groups)

Every intermediate (the cast, the group view, |f|, the amax, the division,
the clamp, the unfloored scale) must have no user outside the pattern, the
floor must be > 0, and the dtypes must be as above (f fp32, n fp16 / bf16 /
fp32): otherwise the graph stays as it is. Left unfused: a multiplication by
a reciprocal (f * (1 / s), f * (448 / amax)): other bits than the division,
which is what the op computes; torchao's float8 activations (a subclass:
aten only, with a scale rounded to the activation's dtype); a quantization
to another dtype (e5m2) or other bounds; a per-tensor scale computed in the
graph (a dynamic per-tensor amax); the aten form of these (the graph AOT
autograd makes, where DTensor's all-reduces first appear).

fuse() moves each call it rewrites from the pattern's key in the counts to
COUNT_KEY[pattern] ("<key>_fp8", the key the op's calls count under in
Communicator.stats()), so the counts name the calls the graph holds.
"""
import operator
import typing

import torch

from . import ops  # noqa: F401 - ops registers the fused ops
from .fp8 import DTYPE, FP8_MAX, GROUP, Quant
from .fusion import _erase, _example, _only_user  # the norm fusion's graph helpers: the same rules
from .fusion import _self_contained as _fusion_self_contained
from .norm_patterns import STATS_KEY, Pattern

COUNT_KEY = {pattern: f"{key}_fp8" for pattern, key in STATS_KEY.items()}
PER_TENSOR, PER_TOKEN, PER_TOKEN_GROUP = (int(q) for q in Quant)
_NORMED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_PUBLIC = torch.ops.tpcomm.custom_all_reduce_add_rms_norm.default
_PRIVATE = torch.ops._tpcomm.all_reduce_norm.default
_RMS_PATTERNS = (Pattern.ADD_NORM, Pattern.NORM_ADD, Pattern.NORM_ADD_NORM)  # the FP8 op's: no LayerNorm
_LOW, _HIGH = (lambda v: _is_number(v, -FP8_MAX)), (lambda v: _is_number(v, FP8_MAX))  # e4m3's saturation
_DIV_FUNCTIONS = (operator.truediv, torch.div, torch.true_divide)
_CLAMP_FUNCTIONS = (torch.clamp, torch.clip)


def _bind(node, functions, method, names):
    """node's arguments by `names` where node calls one of `functions` or the
    Tensor method `method` (the tensor first), else None. A name not given is
    absent from the dict; an argument past `names` makes it None."""
    if not ((node.op == "call_function" and node.target in functions)
            or (node.op == "call_method" and node.target == method)):
        return None
    if len(node.args) > len(names) or any(k not in names for k in node.kwargs):
        return None
    values = dict(zip(names, node.args))
    values.update(node.kwargs)
    return values


def _is_number(value, expected=None):
    """Whether value is a Python number (equal to expected where given)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and expected in (None, float(value))


def _divided(node, divisor_ok):
    """(dividend, divisor) of a true division node, divisor_ok(divisor) holding; else None."""
    args = _bind(node, _DIV_FUNCTIONS, "div", ("input", "other"))
    if args is None and node.op == "call_method" and node.target == "true_divide":
        args = _bind(node, (), "true_divide", ("input", "other"))
    if args is None or set(args) != {"input", "other"} or not divisor_ok(args["other"]):
        return None  # a rounding_mode (or anything else) is another division
    return args["input"], args["other"]


def _clamped(node, low, high):
    """The clamped tensor of node = clamp(x, low, high) with exactly those bounds
    (None where a bound is absent), else None."""
    args = _bind(node, _CLAMP_FUNCTIONS, "clamp", ("input", "min", "max"))
    if args is None and node.op == "call_method" and node.target in ("clip", "clamp_min"):
        args = _bind(node, (), node.target, ("input", "min", "max") if node.target == "clip" else ("input", "min"))
    if args is None or "input" not in args:
        return None
    for name, bound in (("min", low), ("max", high)):
        given = args.get(name)
        if (bound is None) != (given is None) or (bound is not None and not bound(given)):
            return None
    return args["input"]


def _cast_to(node, source, dtype):
    """Whether node is source.to(dtype) / .to(dtype=dtype) (or .float() for fp32)."""
    if node.op != "call_method" or not node.args or node.args[0] is not source:
        return False
    if node.target == "float":
        return dtype == torch.float32 and len(node.args) == 1 and not node.kwargs
    return node.target == "to" and ((node.args[1:] == (dtype,) and not node.kwargs)
                                    or (len(node.args) == 1 and dict(node.kwargs) == {"dtype": dtype}))


class _Quant(typing.NamedTuple):
    quant: int
    scale: "torch.fx.Node | None"   # PER_TENSOR's scale tensor
    floor: float                    # the dynamic scale's floor (0.0 for PER_TENSOR)
    codes: torch.fx.Node            # the node whose users take the op's codes
    codes_view: "tuple | None"      # how the op's codes are viewed to its shape: (method, *args)
    scales: "torch.fx.Node | None"  # the node whose users take the op's scales (dynamic)
    scales_view: "tuple | None"
    erased: list                    # every other node the rewrite removes


def _last_dim(dim, ndim):
    dims = dim if isinstance(dim, (list, tuple)) else (dim,)
    return len(dims) == 1 and isinstance(dims[0], int) and dims[0] in (-1, ndim - 1)


def _amax_of(node, g):
    """The nodes of amax(|g|) over the last dim, keepdim, ending at node
    (node first), each but node with one user; else None."""
    nodes, ndim = [node], _example(g).dim()
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0:
        node = node.args[0]  # .max(dim, keepdim).values: Dynamo's getitem 0 of the max
        args = _bind(node, (torch.max,), "max", ("input", "dim", "keepdim"))
        if _only_user(node) is None:
            return None
        nodes.append(node)
    else:
        args = _bind(node, (torch.amax,), "amax", ("input", "dim", "keepdim"))
    if args is None or not _last_dim(args.get("dim"), ndim) or args.get("keepdim") is not True:
        return None
    absolute = args["input"]
    if not isinstance(absolute, torch.fx.Node) or _only_user(absolute) is not nodes[-1]:
        return None
    abs_args = _bind(absolute, (torch.abs,), "abs", ("input",))
    return nodes + [absolute] if abs_args is not None and abs_args.get("input") is g else None


def _positive(value):
    return _is_number(value) and 0 < value < float("inf")


def _floor(value, then_divided):
    """The fp32 floor torch applies for clamp(min=value) on fp32 (value
    rounded to fp32), divided by 448 in fp32 where the clamp precedes the
    division; None unless finite and > 0 in fp32, as the op requires."""
    floor = torch.tensor(value, dtype=torch.float32)
    floor = float(floor / torch.tensor(FP8_MAX) if then_divided else floor)
    return floor if 0 < floor < float("inf") else None


def _clamp_min(node):
    return node.kwargs.get("min", node.args[1] if len(node.args) > 1 else None)


def _dynamic_scale(s, g):
    """(floor, the nodes from the amax to s, s excluded) of a dynamic scale s
    of g (module doc), or None."""
    inner = _clamped(s, _positive, None)
    if inner is not None:  # (amax / 448).clamp(min=floor)
        divided = _divided(inner, lambda d: _is_number(d, FP8_MAX)) if _only_user(inner) is s else None
        if divided is None or not isinstance(divided[0], torch.fx.Node) or _only_user(divided[0]) is not inner:
            return None
        amax, floor = _amax_of(divided[0], g), _floor(_clamp_min(s), then_divided=False)
        return (floor, [inner] + amax) if amax is not None and floor is not None else None
    divided = _divided(s, lambda d: _is_number(d, FP8_MAX))  # amax.clamp(min=eps) / 448
    clamp = divided[0] if divided is not None else None
    inner = _clamped(clamp, _positive, None) if isinstance(clamp, torch.fx.Node) else None
    if inner is None or _only_user(clamp) is not s or _only_user(inner) is not clamp:
        return None
    amax, floor = _amax_of(inner, g), _floor(_clamp_min(clamp), then_divided=True)
    return (floor, [clamp] + amax) if amax is not None and floor is not None else None


def _static_scale(s, order, anchor):
    """Whether s is a graph tensor (input or attribute) of one fp32 element,
    there before the fused call: the op reads it where the call is."""
    value = _example(s) if isinstance(s, torch.fx.Node) else None
    return value is not None and s.op in ("placeholder", "get_attr") and value.dtype == torch.float32 \
        and value.numel() == 1 and order[s] < order[anchor]


def _groups(f, owned, n_value):
    """(g, view of the op's codes as g, view of its (rows, groups) scales as
    amax's shape) where a user of f (its only one where f is the pattern's
    own cast: `owned`) views it as groups of 128 of each row; else None."""
    views = [u for u in f.users if u.op == "call_method" and u.target in ("view", "reshape") and u.args[0] is f]
    if len(views) != 1 or (owned and any(u is not views[0] and not _is_size(u, f) for u in f.users)):
        return None
    g, hidden = views[0], n_value.shape[-1]
    shape = tuple(_example(g).shape) if _viewed_as(g, torch.float32) else ()  # a .view(dtype) is a bitcast
    if not isinstance(hidden, int) or hidden % GROUP or not shape or shape[-1] != GROUP:
        return None
    if shape[:-1] == tuple(n_value.shape[:-1]) + (hidden // GROUP,):
        return g, ("unflatten", -1, (-1, GROUP)), ("unsqueeze", -1)
    if len(shape) == 2:  # view(-1, 128): rows of whole groups, since hidden % 128 == 0
        return g, ("view", -1, GROUP), ("view", -1, 1)
    return None


def _viewed_as(node, dtype, shape=None):
    """Whether node is a .view / .reshape giving `dtype` (and `shape`, where given)."""
    value = _example(node) if node is not None and node.op == "call_method" else None
    return node is not None and node.target in ("view", "reshape") and value is not None \
        and value.dtype == dtype and (shape is None or tuple(value.shape) == shape)


def _is_size(node, f):
    """Whether node is f.size(): under dynamic shapes Dynamo reads f's shape
    so for the view back to rows (codes.view(f.size()))."""
    return node.op == "call_method" and node.target == "size" and node.args == (f,) and not node.kwargs


def _quant_of(f, owned, n_value, order, anchor):
    """The quantization of f (module doc) as a _Quant, or None. f is the
    pattern's own cast (owned: no other user allowed) or the normed output
    itself (fp32: its other users take the op's normed output)."""
    grouped = _groups(f, owned, n_value)
    g = grouped[0] if grouped else f
    for d in g.users:
        divided = _divided(d, lambda s: isinstance(s, torch.fx.Node))
        clamp = _only_user(d) if divided and divided[0] is g else None
        if clamp is None or _clamped(clamp, _LOW, _HIGH) is not d:
            continue
        q = _only_user(clamp)
        # the codes of the op's shape (or of the groups'): a scale of shape (1, 1) broadcasts a row into 2-D
        if q is None or not _cast_to(q, clamp, DTYPE) or _example(q) is None or _example(q).shape != _example(g).shape:
            continue
        s = divided[1]
        found = _dynamic_scale(s, g)
        if found is None and not grouped and _static_scale(s, order, anchor):
            quant, floor, chain, scales = PER_TENSOR, 0.0, [], None
        elif found is not None:
            quant, (floor, chain), scales = (PER_TOKEN_GROUP if grouped else PER_TOKEN), found, s
        else:
            continue
        inside = {d} | ({chain[-1]} if chain else set())  # g's users: the division and |g|
        if not (set(g.users) == inside or (g is f and not owned and inside <= set(g.users))):
            continue
        codes, codes_view = q, grouped[1] if grouped else None
        back = _only_user(q)
        if grouped and _viewed_as(back, DTYPE, tuple(n_value.shape)):
            codes, codes_view = back, None  # viewed back to n's shape: the op's codes as they are
        sizes = [u for u in f.users if _is_size(u, f)] if grouped and owned else []
        if any(set(size.users) != {codes} for size in sizes):
            continue  # f's shape read for anything but the view back, which goes: f has to stay
        erased = [d, clamp] + chain + ([q] if codes is not q else []) + ([g] if grouped else []) + sizes
        return _Quant(quant, s if quant == PER_TENSOR else None, floor, codes, codes_view, scales,
                      grouped[2] if grouped else None, erased)
    return None


def _candidates(n):
    """(f, the cast node erased or None) for each fp32 view of n a quantization may start from."""
    value = _example(n)
    if value is None or value.dtype not in _NORMED_DTYPES:
        return
    if value.dtype == torch.float32:
        yield n, None
    for user in list(n.users):
        if _cast_to(user, n, torch.float32):
            yield user, user


def _norm_call(call):
    """(pattern, the op's leading arguments (x, residual, weight, next_weight, eps,
    next_eps, weight_offset), group, {output index: its getitem node}) of a
    fused-norm call whose every user takes one output by getitem, else None."""
    if call.op != "call_function" or call.kwargs or call.target not in (_PUBLIC, _PRIVATE):
        return None
    if call.target is _PUBLIC and len(call.args) == 5:
        x, residual, weight, eps, group = call.args
        pattern, args = Pattern.ADD_NORM, (x, residual, weight, None, eps, eps, 0.0)
    elif call.target is _PRIVATE and len(call.args) == 9 and call.args[7] in _RMS_PATTERNS:
        pattern, args, group = Pattern(call.args[7]), tuple(call.args[:7]), call.args[8]
    else:
        return None
    outputs = {}
    for user in call.users:
        if user.target is not operator.getitem or user.args[0] is not call or user.args[1] in outputs:
            return None  # a tuple used whole, or one output taken twice: left as it is
        outputs[user.args[1]] = user
    return pattern, args, group, outputs


def _find(call, order):
    """(pattern, args, group, outputs, the quantization, the cast erased or
    None, the output index it quantizes) of a fused-norm call whose normed
    output is quantized (module doc), or None. NORM_ADD's normed output is
    its stream output (o, o): the graph reads it from output 1."""
    found = _norm_call(call)
    if found is None:
        return None
    pattern, outputs = found[0], found[3]
    for index in (0, 1) if pattern == Pattern.NORM_ADD else (0,):
        n = outputs.get(index)
        if n is None or _example(n) is None:
            continue
        for f, cast in _candidates(n):
            quant = _quant_of(f, cast is not None, _example(n), order, call)
            if quant is not None:
                return found + (quant, cast, index)
    return None


def _view(graph, node, how, like):
    """node viewed by how = (method, *args) (no view where how is None),
    inserted after node, with the meta of `like` (the node it stands for)."""
    if how is None:
        return node
    with graph.inserting_after(node):
        view = graph.call_method(how[0], (node,) + tuple(how[1:]))
    view.meta.update({k: like.meta[k] for k in ("example_value", "val") if k in like.meta})
    return view


def _rewrite(graph, call, found):
    pattern, (x, residual, weight, next_weight, eps, next_eps, offset), group, outputs, q, cast, source = found
    erased = q.erased + ([cast] if cast is not None else [])
    n = outputs[source]
    # the normed output's other users read the op's (NORM_ADD's stream output is its normed output)
    keep_normed = source == 0 and any(u not in erased and u is not q.codes for u in n.users)
    with graph.inserting_after(call):
        fp8 = graph.call_function(torch.ops._tpcomm.all_reduce_norm_fp8.default,
                                  (x, residual, weight, next_weight, eps, next_eps, offset, int(pattern), q.quant,
                                   q.scale, q.floor, False, keep_normed, group))
    taken = {}
    for index in (3, 2, 1, 0):  # codes, scales, stream, normed: getitem nodes in that order
        with graph.inserting_after(fp8):
            taken[index] = graph.call_function(operator.getitem, (fp8, index))
    _take(q.codes, _view(graph, taken[0], q.codes_view, q.codes))
    if q.scales is not None:
        _take(q.scales, _view(graph, taken[1], q.scales_view, q.scales))
    if 1 in outputs:
        _take(outputs[1], taken[2])
    _erase(graph, [q.codes] + ([q.scales] if q.scales is not None else []) + erased)
    if keep_normed:
        _take(n, taken[3])
    for node in [outputs.get(0), outputs.get(1), call, *taken.values()]:
        if node is not None and not node.users:
            graph.erase_node(node)


def _take(node, replacement):
    """replacement stands for node: node's users and recorded value go to it."""
    if replacement.op == "call_function" and replacement.target is operator.getitem:
        replacement.meta.update({k: node.meta[k] for k in ("example_value", "val") if k in node.meta})
    node.replace_all_uses_with(replacement)


def _self_contained(q, cast):
    """tpcomm.fusion's rule: every node the rewrite erases (the quantization,
    the cast) is used only by nodes it removes; codes and scales hand their
    users the op's outputs."""
    return _fusion_self_contained([n for n in (q.codes, q.scales) if n is not None],
                                  q.erased + ([cast] if cast is not None else []))


def fuse(gm: torch.fx.GraphModule) -> dict:
    """Rewrites gm's graph in place (module doc); returns {COUNT_KEY[pattern]:
    calls rewritten, STATS_KEY[pattern]: minus that many} to add to the counts."""
    graph = gm.graph
    moved = dict.fromkeys(COUNT_KEY.values(), 0)
    moved.update(dict.fromkeys(STATS_KEY.values(), 0))
    for call in list(graph.nodes):
        if call.graph is not graph or call.op != "call_function" or call.target not in (_PUBLIC, _PRIVATE):
            continue
        found = _find(call, {node: i for i, node in enumerate(graph.nodes)})
        if found is None or not _self_contained(found[4], found[5]):
            continue  # matched in full before anything changes: never a half-rewritten graph
        _rewrite(graph, call, found)
        moved[COUNT_KEY[found[0]]] += 1
        moved[STATS_KEY[found[0]]] -= 1
    if any(moved.values()):
        graph.lint()
        gm.recompile()
    return moved
