"""A torch.compile pass that puts a model's residual add and RMSNorm into the
all-reduce, so models need no edit to use the fused op:

    compiled = torch.compile(model, backend=tpcomm.compile_backend())            # inductor after the pass
    compiled = torch.compile(model, backend=tpcomm.compile_backend("aot_eager"))

(tpcomm.graph_pass runs this fusion after it has put the collectives on
tpcomm; this module does not import it: the pass depends on the fusion, not
the other way round.)

The graph AOT autograd makes (inductor's post-grad pass, aot_eager's forward
compiler) is matched the same way, its norm in aten ops
(tpcomm.aten_norms): there the all-reduces appear that Dynamo's graph holds
as DTensor's redistribute (transformers 4.x's row-parallel layers).

In the graph Dynamo captures, every (torch's own all_reduce included, which
tpcomm.graph_pass first puts on tpcomm)

    z = residual + torch.ops.tpcomm.custom_all_reduce(y, group_name) [* m]    (either order of each)
    h = norm(z)      (an RMSNorm or LayerNorm as tpcomm.dynamo_norms finds them:
                      F.rms_norm, Llama's, Gemma's; F.layer_norm, nn.LayerNorm, Cohere's)

becomes h, z = torch.ops.tpcomm.custom_all_reduce_add_rms_norm(y, residual,
weight, eps, group_name) (an RMSNorm with weight w and no multiplier) or
torch.ops._tpcomm.all_reduce_norm(..., pattern, group_name, bias=,
residual_scale=m) (the others; norm_patterns.Pattern), and likewise the
norm before the add (residual + norm(all_reduce(y)) [* m], NORM_ADD) and
on both sides of it (NORM_ADD_NORM, both norms of one kind), where the
shapes and dtypes Dynamo recorded allow it: y and
residual of one shape and dtype, weight (and bias) of that dtype and of the last
dimension's length, an explicit weight for an RMSNorm, eps a number or none (torch's
default then), m a number or a symbolic float (not a tensor), and every value the rewrite removes (the
all-reduce's result, what lies between it and the add, the norm's inner
nodes and casts) used only inside the pattern: the fused op has no output
for it. Other users of z take the fused op's z. What does not match is
left as it is (other spellings of a norm included: write them with
F.rms_norm / F.layer_norm, or call Communicator.all_reduce_add_rms_norm).
The fused op computes in fp32 from the sum to the norm and rounds once, where
the unfused model rounds z first (and the Llama-style norm rounds again
before the weight): the normed values can differ from the model's in the
last bit or two.

eps: a float, or under torch.compile(dynamic=True), where Dynamo passes a
module's float as a 0-dim tensor and reads it with .item(), that item (a
symbolic float), which the fused op takes as its eps. Inductor then cannot
turn that float into a tensor and restarts the frame with the float a
constant (TensorifyScalarRestartAnalysis), so the graph it compiles holds the
fused op with eps written in; other inner backends call the op with the
float .item() returns.
"""
import operator

import torch

from . import aten_norms, ops  # noqa: F401 - ops registers torch.ops.tpcomm.custom_all_reduce and the fused ops
from .dynamo_norms import any_norm as _any_norm, as_eps as _eps, example as _example, is_call as _is_call
from .dynamo_norms import only_user as _only_user
from .norm_patterns import STATS_KEY, Pattern

_ALL_REDUCE = (torch.ops.tpcomm.custom_all_reduce, torch.ops.tpcomm.custom_all_reduce.default)
_ADD = (operator.add, operator.iadd, torch.add, torch.ops.aten.add.Tensor)
_MUL = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)


_DROPOUT = (torch.nn.functional.dropout, torch.dropout, torch.ops.aten.dropout.default)
_LAYOUT_METHODS = ("view", "reshape", "contiguous")


def _identity(node):
    """Whether node gives its first argument's values unchanged at inference:
    dropout with p = 0 or training off, a view / reshape / contiguous (the
    layout of a contiguous tensor kept: same elements in the same order)."""
    if node.op == "call_function" and node.target in _DROPOUT:
        names = ("input", "p", "train" if node.target is torch.dropout or node.target in _DROPOUT[2:] else "training")
        values = dict(zip(names, node.args))
        values.update(node.kwargs)
        return values.get("p", 0.5) == 0.0 or values.get(names[2], True) is False
    if node.op == "call_method" and node.target in _LAYOUT_METHODS and not node.kwargs:
        before, after = _example(node.args[0]), _example(node)
        return before is not None and after is not None and before.is_contiguous() and after.is_contiguous() \
            and before.numel() == after.numel()
    return aten_norms.identity(node)


def _through_identities(ar):
    """(the last node of the chain of single-user identity nodes after ar, the
    chain): the value ar's sum reaches its consumer as."""
    chain, node = [], ar
    while len(node.users) == 1:
        (user,) = node.users
        if not _identity(user) or user.args[0] is not node:
            break
        chain.append(user)
        node = user
    return node, chain


def _reapplied(graph, y, chain):
    """y with chain's layout changes applied (dropout skipped), inserted
    before the chain's first node: the fused op's input of the consumer's
    shape. Always a reshape: the chain viewed the all-reduce's contiguous
    result, but y, the model's tensor, may be of any layout (a reshape keeps
    the elements in the same order, copying where a view cannot)."""
    for node in chain:
        if node.op == "call_method" and node.target in ("view", "reshape"):
            with graph.inserting_before(chain[0]):
                y = graph.call_method("reshape", (y,) + tuple(node.args[1:]))
            if "example_value" in node.meta:
                y.meta["example_value"] = node.meta["example_value"]
    return y


def _pattern(position, kind):
    """The pattern of an RMSNorm `position` (ADD_NORM, NORM_ADD, NORM_ADD_NORM) for a norm of `kind`."""
    return position if kind == "rms" else Pattern[position.name.replace("NORM", "LAYER_NORM")]


def _weight_ok(weight, ty, order, before):
    tw = _example(weight)
    return tw is not None and tw.dtype == ty.dtype and tuple(tw.shape) == (ty.shape[-1],) and order[weight] < order[before]


def _params_ok(kind, weight, bias, ty, order, before):
    """A norm's weight and bias as the fused op takes them: each of ty's dtype and last dimension,
    made before `before`; LayerNorm's optional, RMSNorm's weight required."""
    return (weight is not None or kind == "layer") and all(
        t is None or _weight_ok(t, ty, order, before) for t in (weight, bias))


def _scaled(node):
    """(node's one user node * m, m) where m is a number or a symbolic float
    (.item() of a 0-dim tensor, as _eps): the residual scale; else (node, 1.0).
    A tensor factor is no scale."""
    mul = _only_user(node)
    if mul is None or not _is_call(mul, _MUL) or mul.kwargs or len(mul.args) != 2 or node not in mul.args \
            or mul.args[0] is mul.args[1]:
        return node, 1.0
    m = mul.args[1] if mul.args[0] is node else mul.args[0]
    if isinstance(m, (int, float)) and not isinstance(m, bool):
        return mul, float(m)
    return (mul, m) if isinstance(m, torch.fx.Node) and _eps(m) is not None else (node, 1.0)


def _add_of(node):
    """(node's one user, an add of it and another node, that other node), or None."""
    add = _only_user(node)
    if add is None or add.op != "call_function" or add.target not in _ADD or add.kwargs or len(add.args) != 2:
        return None
    other = add.args[1] if add.args[0] is node else add.args[0]
    return (add, other) if isinstance(other, torch.fx.Node) and other is not node else None


def _residual_ok(residual, ty):
    tr = _example(residual)
    return tr is not None and tr.shape == ty.shape and tr.dtype == ty.dtype


def _match_sandwich(a, ty, order):
    """a -> norm [* m] -> add of a residual [-> the next norm of the same kind]: (pattern, args
    (residual, weight, next_weight, eps, next_eps, weight_offset), the op's keyword args, the add,
    {node replaced: output index}, nodes erased), or None."""
    norm = _any_norm(a, ty.dtype, ty.shape[-1])
    if norm is None:
        return None
    kind, weight, bias, eps, offset, out, erased = norm
    term, scale = _scaled(out)
    found = _add_of(term)
    if found is None or not _residual_ok(found[1], ty) or not isinstance(eps, float) \
            or not _params_ok(kind, weight, bias, ty, order, found[0]):
        return None
    (add, residual), erased = found, erased + ([term] if term is not out else [])
    extra = {k: v for k, v in (("bias", bias), ("residual_scale", scale)) if v is not None and v != 1.0}
    after = _any_norm(add, ty.dtype, ty.shape[-1])
    if after is not None:
        kind2, w2, b2, eps2, offset2, out2, erased2 = after
        if kind2 == kind and offset2 == offset and isinstance(eps2, float) \
                and _params_ok(kind, w2, b2, ty, order, add):
            extra.update({"next_bias": b2} if b2 is not None else {})
            return (_pattern(Pattern.NORM_ADD_NORM, kind), (residual, weight, w2, eps, eps2, offset), extra, add,
                    {out2: 0, add: 1}, erased2 + erased)
    return _pattern(Pattern.NORM_ADD, kind), (residual, weight, None, eps, eps, offset), extra, add, {add: 1}, erased


def _match(ar, order):
    """One all_reduce (through identities) and the add and norm(s) around
    it: (pattern, (y, residual, weight, next_weight, eps, next_eps,
    weight_offset), the op's keyword args (bias, next_bias, residual_scale
    where not their defaults), group, the node the fused op goes after,
    {node replaced: the fused op's output index}, the nodes erased with ar),
    or None."""
    a, chain = _through_identities(ar)
    y = ar.args[0] if len(ar.args) > 0 else ar.kwargs.get("x")
    group = ar.args[1] if len(ar.args) > 1 else ar.kwargs.get("group_name")
    ty, ta = _example(y), _example(a)
    if ty is None or ta is None or not isinstance(group, str) or ta.dim() < 1 or ta.dtype != ty.dtype:
        return None
    ty = ta  # the consumer's shape: y goes in with the chain's layout changes applied
    term, scale = _scaled(a)
    found = _add_of(term)
    if found is None:
        sandwich = _match_sandwich(a, ty, order)
        if sandwich is None:
            return None
        pattern, args, extra, anchor, replaced, erased = sandwich
        return pattern, (y,) + args, extra, group, anchor, replaced, erased + chain
    add, residual = found
    if not _residual_ok(residual, ty):
        return None
    norm = _any_norm(add, ty.dtype, ty.shape[-1])
    if norm is None:
        return None
    kind, weight, bias, eps, offset, out, erased = norm
    if not _params_ok(kind, weight, bias, ty, order, add):  # the fused op goes where the add is
        return None
    # Dynamo reads a symbolic eps (.item()) where the norm uses it, after the add: the read moves
    # before the add (fuse), which its tensor must precede
    if isinstance(eps, torch.fx.Node) and (offset or order[eps.args[0]] > order[add]):
        return None
    extra = {k: v for k, v in (("bias", bias), ("residual_scale", scale)) if v is not None and v != 1.0}
    return _pattern(Pattern.ADD_NORM, kind), (y, residual, weight, None, eps, eps, offset), extra, group, add, \
        {out: 0, add: 1}, erased + chain + ([term] if term is not a else [])


def _self_contained(replaced, erased):
    """Whether the nodes the rewrite removes are used only inside the
    pattern: each one erased (the all-reduce, the nodes between it and its
    consumer, a norm's inner nodes and casts; tpcomm.fusion_fp8's
    quantization) has users only among the removed nodes; a node replaced
    hands its users the fused op's output instead. A value that a node
    outside the pattern reads has no output of the fused op to come from,
    so such a pattern is left as it is."""
    removed = set(erased) | set(replaced)
    return all(user in removed for node in removed - set(replaced) for user in node.users)


def _erase(graph, nodes):
    """Erases `nodes`, each once nothing uses it (_self_contained made sure
    that all of them go)."""
    left = list(dict.fromkeys(nodes))
    while left:
        free = [n for n in left if not n.users]
        if not free:
            raise RuntimeError(f"tpcomm.fusion: nodes still in use: {left}")
        for node in free:
            graph.erase_node(node)
            left.remove(node)


def fuse(gm: torch.fx.GraphModule) -> dict:
    """Rewrites gm's graph in place (see the module's doc); returns how many
    of each pattern it fused, by the pattern's stats key."""
    graph = gm.graph
    fused = dict.fromkeys(STATS_KEY.values(), 0)
    for ar in list(graph.nodes):
        if ar.op != "call_function" or ar.target not in _ALL_REDUCE or ar.graph is not graph:
            continue
        order = {node: i for i, node in enumerate(graph.nodes)}
        found = _match(ar, order)
        if found is None or not _self_contained(found[5], list(found[6]) + [ar]):
            continue  # matched in full before anything changes: never a half-rewritten graph
        pattern, (y, residual, weight, next_weight, eps, next_eps, offset), extra, group, anchor, replaced, \
            erased = found
        chain = [n for n in erased if n in _through_identities(ar)[1]]
        y = _reapplied(graph, y, chain)
        if isinstance(eps, torch.fx.Node) and order[eps] > order[anchor]:
            anchor.prepend(eps)
        with graph.inserting_after(anchor):
            if pattern == Pattern.ADD_NORM and not offset and not extra:
                call = graph.call_function(torch.ops.tpcomm.custom_all_reduce_add_rms_norm.default,
                                           (y, residual, weight, eps, group))
            else:  # the keyword arguments only where not their defaults: RMSNorm's calls as before
                call = graph.call_function(torch.ops._tpcomm.all_reduce_norm.default,
                                           (y, residual, weight, next_weight, eps, next_eps, offset, int(pattern),
                                            group), extra)
        outputs = {}
        for index in (1, 0):
            with graph.inserting_after(call):
                outputs[index] = graph.call_function(operator.getitem, (call, index))
        for node, index in replaced.items():
            outputs[index].meta.update({k: node.meta[k] for k in ("example_value", "val") if k in node.meta})
            node.replace_all_uses_with(outputs[index])
        _erase(graph, erased + list(replaced) + [ar])
        fused[STATS_KEY[pattern]] += 1
    if any(fused.values()):
        graph.lint()
        gm.recompile()
    return fused
