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

    z = residual + torch.ops.tpcomm.custom_all_reduce(y, group_name)      (either order of the add)
    h = torch.nn.functional.rms_norm(z, (hidden,), weight, eps)      (torch.nn.RMSNorm calls it)
      or Llama-style model code (Hugging Face's LlamaRMSNorm and its copies):
    h = weight * (z.to(float32) * torch.rsqrt(z.to(float32).pow(2).mean(-1, keepdim=True) + eps)).to(z.dtype)

becomes h, z = torch.ops.tpcomm.custom_all_reduce_add_rms_norm(y, residual, weight,
eps, group_name), where the shapes and dtypes Dynamo recorded allow it: y and
residual of one shape and dtype, weight of that dtype and of the last
dimension's length, an explicit weight, eps a number or none (torch's
default then, _default_eps), and every value the rewrite removes (the
all-reduce's result, what lies between it and the add, the norm's inner
nodes and casts) used only inside the pattern: the fused op has no output
for it. Other users of z take the fused op's z. What does not match is
left as it is (other spellings of a norm included: write them with
F.rms_norm, or call Communicator.all_reduce_add_rms_norm).
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
from .norm_patterns import STATS_KEY, Pattern

_ALL_REDUCE = (torch.ops.tpcomm.custom_all_reduce, torch.ops.tpcomm.custom_all_reduce.default)
_ADD = (operator.add, operator.iadd, torch.add, torch.ops.aten.add.Tensor)
_RMS_NORM = (torch.rms_norm, torch.nn.functional.rms_norm, torch.ops.aten.rms_norm.default)


def _example(node):
    """The tensor Dynamo (example_value) or AOT autograd (val) recorded for node, or None."""
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _norm_args(norm):
    """(input, normalized_shape, weight, eps) of an rms_norm call (eps None
    where the call gives none), or None."""
    names = ("input", "normalized_shape", "weight", "eps")
    values = {"eps": None}
    values.update(zip(names, norm.args))
    values.update({k: v for k, v in norm.kwargs.items() if k in names})
    if set(values) != set(names):
        return None
    return tuple(values[n] for n in names)


def _eps(value):
    """value as the fused op's eps: a float, or the node of a 0-dim float
    tensor's .item() (see the module's doc); else None."""
    if isinstance(value, float):
        return value
    if isinstance(value, torch.fx.Node) and _is_method(value, "item"):
        source = _example(value.args[0]) if isinstance(value.args[0], torch.fx.Node) else None
        if source is not None and source.dim() == 0 and source.dtype.is_floating_point:
            return value
    return None


def _default_eps(dtype):
    """The eps torch's rms_norm takes when given none (torch.nn.RMSNorm's
    default): the machine epsilon of the type it computes in, fp32 for
    fp16 / bf16 / fp32 inputs and fp64 for fp64."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def _functional_norm(z, dtype, hidden):
    """z's F.rms_norm(z, (hidden,), weight, eps) user, z of `dtype`: (weight,
    eps, the node to replace, the nodes to erase), or None."""
    for norm in z.users:
        if norm.op != "call_function" or norm.target not in _RMS_NORM:
            continue
        args = _norm_args(norm)
        if args is None:
            continue
        source, shape, weight, eps = args
        if eps is None:
            eps = _default_eps(dtype)
        if source is z and isinstance(weight, torch.fx.Node) and _eps(eps) is not None and tuple(shape) == (hidden,):
            return weight, eps, norm, [norm]
    return None


def _is_method(node, name, *args, **kwargs):
    return (node.op == "call_method" and node.target == name and tuple(node.args[1:]) == args
            and dict(node.kwargs) == kwargs)


def _is_call(node, targets):
    return node.op == "call_function" and node.target in targets


def _only_user(node):
    return next(iter(node.users)) if len(node.users) == 1 else None


def _normalised(z, eps_ok):
    """Each h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) of model code
    with h = z.float() (or z.to(float32)), one per user of z that starts one:
    yields (scaled, eps, the chain's nodes from scaled back to h). eps_ok(eps)
    says which eps the caller takes."""
    for up in z.users:
        if not (_is_method(up, "to", torch.float32) or _is_method(up, "float")) or len(up.users) != 2:
            continue
        square = next((u for u in up.users if _is_method(u, "pow", 2)), None)
        scaled = next((u for u in up.users if _is_call(u, (operator.mul, torch.mul))), None)
        mean = square and _only_user(square)
        if scaled is None or mean is None or not (_is_method(mean, "mean", -1, keepdim=True)
                                                  or _is_method(mean, "mean", -1, True)):
            continue
        plus = _only_user(mean)
        if plus is None or not _is_call(plus, (operator.add, torch.add)) or plus.args[0] is not mean \
                or not eps_ok(plus.args[1]) or plus.kwargs:
            continue
        root = _only_user(plus)
        if root is None or not _is_call(root, (torch.rsqrt,)) or _only_user(root) is not scaled \
                or set(scaled.args) != {up, root} or scaled.kwargs:
            continue
        yield scaled, plus.args[1], [scaled, root, plus, mean, square, up]


def _written_norm(z, dtype):
    """The norm of Llama-style model code (Hugging Face's LlamaRMSNorm and its
    copies) on z: h * rsqrt(mean(h^2) + eps) (_normalised), back to z's dtype,
    times weight. (weight, eps, the node to replace, the nodes to erase), or
    None."""
    for scaled, eps, chain in _normalised(z, lambda e: _eps(e) is not None):
        down = _only_user(scaled)
        if down is None or not _is_method(down, "to", dtype):
            continue
        out = _only_user(down)
        if out is None or not _is_call(out, (operator.mul, torch.mul)) or down not in out.args or out.kwargs:
            continue
        weight = out.args[1] if out.args[0] is down else out.args[0]
        if isinstance(weight, torch.fx.Node):
            return weight, eps, out, [out, down] + chain
    return None


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


def _gemma_norm(z):
    """The norm of Gemma-style model code on z: h * rsqrt(mean(h^2) + eps)
    (_normalised) times (1.0 + weight.float()), .type_as(z). (weight, eps, the
    node to replace, the nodes to erase), or None."""
    for scaled, eps, chain in _normalised(z, lambda e: isinstance(e, float)):
        times = _only_user(scaled)
        if times is None or not _is_call(times, (operator.mul, torch.mul)) or times.args[0] is not scaled \
                or times.kwargs:
            continue
        offset = times.args[1]
        if not (isinstance(offset, torch.fx.Node) and _is_call(offset, (operator.add, torch.add))
                and offset.args[0] == 1.0 and len(offset.users) == 1 and not offset.kwargs):
            continue
        wf = offset.args[1]
        if not (isinstance(wf, torch.fx.Node) and _is_method(wf, "float") and len(wf.users) == 1):
            continue
        out = _only_user(times)
        if out is None or not (out.op == "call_method" and out.target == "type_as" and out.args == (times, z)):
            continue
        return wf.args[0], eps, out, [out, times, offset, wf] + chain
    return None


def _any_norm(z, dtype, hidden):
    """(weight, eps, weight_offset, node replaced, nodes erased) of an RMSNorm of z, or None."""
    found = _functional_norm(z, dtype, hidden) or _written_norm(z, dtype)
    if found is not None:
        return found[0], found[1], 0.0, found[2], found[3]
    found = _gemma_norm(z)
    if found is not None:
        return found[0], found[1], 1.0, found[2], found[3]
    return aten_norms.find(z, dtype)


def _weight_ok(weight, ty, order, before):
    tw = _example(weight)
    return tw is not None and tw.dtype == ty.dtype and tuple(tw.shape) == (ty.shape[-1],) and order[weight] < order[before]


def _match_sandwich(ar, a, ty, group, order):
    """ar (through identities, as a) -> RMSNorm -> add of a residual
    [-> the next RMSNorm]: (pattern, args of _tpcomm.all_reduce_norm but the group,
    the add, {node replaced: output index}, nodes erased), or None."""
    norm = _any_norm(a, ty.dtype, ty.shape[-1])
    if norm is None:
        return None
    weight, eps, offset, out, erased = norm
    add = _only_user(out)
    if add is None or add.op != "call_function" or add.target not in _ADD or add.kwargs or len(add.args) != 2:
        return None
    residual = add.args[1] if add.args[0] is out else add.args[0]
    tr = _example(residual)
    if not isinstance(residual, torch.fx.Node) or residual is out or tr is None or tr.shape != ty.shape \
            or tr.dtype != ty.dtype or not isinstance(eps, float) or not _weight_ok(weight, ty, order, add):
        return None
    y = ar.args[0] if len(ar.args) > 0 else ar.kwargs.get("x")
    after = _any_norm(add, ty.dtype, ty.shape[-1])
    if after is not None:
        w2, eps2, offset2, out2, erased2 = after
        if offset2 == offset and isinstance(eps2, float) and _weight_ok(w2, ty, order, add):
            return (Pattern.NORM_ADD_NORM, (y, residual, weight, w2, eps, eps2, offset), add,
                    {out2: 0, add: 1}, erased2 + erased)
    return Pattern.NORM_ADD, (y, residual, weight, None, eps, eps, offset), add, {add: 1}, erased


def _match(ar, order):
    """One all_reduce (through identities) and the add and norm(s) around
    it: (pattern, (y, residual, weight, next_weight, eps, next_eps,
    weight_offset), group, the node the fused op goes after, {node replaced:
    the fused op's output index}, the nodes erased with ar), or None."""
    a, chain = _through_identities(ar)
    y = ar.args[0] if len(ar.args) > 0 else ar.kwargs.get("x")
    group = ar.args[1] if len(ar.args) > 1 else ar.kwargs.get("group_name")
    ty, ta = _example(y), _example(a)
    if ty is None or ta is None or not isinstance(group, str) or ta.dim() < 1 or ta.dtype != ty.dtype:
        return None
    ty = ta  # the consumer's shape: y goes in with the chain's layout changes applied
    add = _only_user(a)
    if add is None or add.op != "call_function" or add.target not in _ADD or add.kwargs or len(add.args) != 2:
        sandwich = _match_sandwich(ar, a, ty, group, order)
        if sandwich is None:
            return None
        pattern, args, anchor, replaced, erased = sandwich
        return pattern, args, group, anchor, replaced, erased + chain
    residual = add.args[1] if add.args[0] is a else add.args[0]
    if residual is a or not isinstance(residual, torch.fx.Node):
        return None
    tr = _example(residual)
    if tr is None or ty.shape != tr.shape or ty.dtype != tr.dtype:
        return None
    norm = _any_norm(add, ty.dtype, ty.shape[-1])
    if norm is None:
        return None
    weight, eps, offset, out, erased = norm
    if not _weight_ok(weight, ty, order, add):  # the fused op goes where the add is: its inputs must exist there
        return None
    # Dynamo reads a symbolic eps (.item()) where the norm uses it, after the add: the read moves
    # before the add (fuse), which its tensor must precede
    if isinstance(eps, torch.fx.Node) and (offset or order[eps.args[0]] > order[add]):
        return None
    return Pattern.ADD_NORM, (y, residual, weight, None, eps, eps, offset), group, add, {out: 0, add: 1}, \
        erased + chain


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
        if found is None or not _self_contained(found[4], list(found[5]) + [ar]):
            continue  # matched in full before anything changes: never a half-rewritten graph
        pattern, (y, residual, weight, next_weight, eps, next_eps, offset), group, anchor, replaced, erased = found
        chain = [n for n in erased if n in _through_identities(ar)[1]]
        y = _reapplied(graph, y, chain)
        if isinstance(eps, torch.fx.Node) and order[eps] > order[anchor]:
            anchor.prepend(eps)
        with graph.inserting_after(anchor):
            if pattern == Pattern.ADD_NORM and not offset:
                call = graph.call_function(torch.ops.tpcomm.custom_all_reduce_add_rms_norm.default,
                                           (y, residual, weight, eps, group))
            else:
                call = graph.call_function(torch.ops._tpcomm.all_reduce_norm.default,
                                           (y, residual, weight, next_weight, eps, next_eps, offset, int(pattern),
                                            group))
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
