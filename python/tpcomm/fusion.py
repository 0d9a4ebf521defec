"""A torch.compile pass that puts a model's residual add and RMSNorm into the
all-reduce, so models need no edit to use the fused op:

    compiled = torch.compile(model, backend=tpcomm.compile_backend())            # inductor after the pass
    compiled = torch.compile(model, backend=tpcomm.compile_backend("aot_eager"))

In the graph Dynamo captures, every (torch's own all_reduce included, which
tpcomm.compile_pass first puts on tpcomm)

    z = residual + torch.ops.tpcomm.custom_all_reduce(y, group_name)      (either order of the add)
    h = torch.nn.functional.rms_norm(z, (hidden,), weight, eps)      (torch.nn.RMSNorm calls it)
      or Llama-style model code (Hugging Face's LlamaRMSNorm and its copies):
    h = weight * (z.to(float32) * torch.rsqrt(z.to(float32).pow(2).mean(-1, keepdim=True) + eps)).to(z.dtype)

becomes h, z = torch.ops.tpcomm.custom_all_reduce_add_rms_norm(y, residual, weight,
eps, group_name), where the shapes and dtypes Dynamo recorded allow it: y and
residual of one shape and dtype, weight of that dtype and of the last
dimension's length, an explicit weight and eps, and the all-reduce used only
by the add (its result is not kept). Other users of z take the fused op's z.
What does not match is left as it is (other spellings of a norm included:
write them with F.rms_norm, or call Communicator.all_reduce_add_rms_norm).
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

from . import ops  # noqa: F401 - registers torch.ops.tpcomm.custom_all_reduce and the fused op

_ALL_REDUCE = (torch.ops.tpcomm.custom_all_reduce, torch.ops.tpcomm.custom_all_reduce.default)
_ADD = (operator.add, operator.iadd, torch.add, torch.ops.aten.add.Tensor)
_RMS_NORM = (torch.rms_norm, torch.nn.functional.rms_norm, torch.ops.aten.rms_norm.default)


def _example(node):
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _norm_args(norm):
    """(input, normalized_shape, weight, eps) of an rms_norm call, or None."""
    names = ("input", "normalized_shape", "weight", "eps")
    values = dict(zip(names, norm.args))
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


def _functional_norm(z, hidden):
    """z's F.rms_norm(z, (hidden,), weight, eps) user: (weight, eps, the
    node to replace, the nodes to erase), or None."""
    for norm in z.users:
        if norm.op != "call_function" or norm.target not in _RMS_NORM:
            continue
        args = _norm_args(norm)
        if args is None:
            continue
        source, shape, weight, eps = args
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


def _written_norm(z, dtype):
    """The norm of Llama-style model code (Hugging Face's LlamaRMSNorm and its
    copies) on z: h = z.to(float32); h * rsqrt(h.pow(2).mean(-1, keepdim=True)
    + eps), back to z's dtype, times weight. (weight, eps, the node to
    replace, the nodes to erase), or None."""
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
                or _eps(plus.args[1]) is None or plus.kwargs:
            continue
        root = _only_user(plus)
        if root is None or not _is_call(root, (torch.rsqrt,)) or _only_user(root) is not scaled \
                or set(scaled.args) != {up, root} or scaled.kwargs:
            continue
        down = _only_user(scaled)
        if down is None or not _is_method(down, "to", dtype):
            continue
        out = _only_user(down)
        if out is None or not _is_call(out, (operator.mul, torch.mul)) or down not in out.args or out.kwargs:
            continue
        weight = out.args[1] if out.args[0] is down else out.args[0]
        if isinstance(weight, torch.fx.Node):
            return weight, plus.args[1], out, [out, down, scaled, root, plus, mean, square, up]
    return None


def _match(ar, order):
    """One all_reduce -> add -> norm: (y, residual, weight, eps, group, add,
    the node the normed output replaces, the nodes to erase), or None."""
    if len(ar.users) != 1:
        return None
    (add,) = ar.users
    if add.op != "call_function" or add.target not in _ADD or add.kwargs or len(add.args) != 2:
        return None
    residual = add.args[1] if add.args[0] is ar else add.args[0]
    if residual is ar or not isinstance(residual, torch.fx.Node):
        return None
    y = ar.args[0] if len(ar.args) > 0 else ar.kwargs.get("x")
    group = ar.args[1] if len(ar.args) > 1 else ar.kwargs.get("group_name")
    ty, tr = _example(y), _example(residual)
    if ty is None or tr is None or not isinstance(group, str) or ty.dim() < 1 \
            or ty.shape != tr.shape or ty.dtype != tr.dtype:
        return None
    norm = _functional_norm(add, ty.shape[-1]) or _written_norm(add, ty.dtype)
    if norm is None:
        return None
    weight, eps, out, erased = norm
    tw = _example(weight)
    if tw is None or tw.dtype != ty.dtype or tuple(tw.shape) != (ty.shape[-1],):
        return None
    if order[weight] > order[add]:  # the fused op goes where the add is: its inputs must exist there
        return None
    # Dynamo reads a symbolic eps (.item()) where the norm uses it, after the add: the read moves
    # before the add (fuse_all_reduce_add_rms_norm), which its tensor must precede
    if isinstance(eps, torch.fx.Node) and order[eps.args[0]] > order[add]:
        return None
    return y, residual, weight, eps, group, add, out, erased


def fuse_all_reduce_add_rms_norm(gm: torch.fx.GraphModule) -> int:
    """Rewrites gm's graph in place (see the module's doc); returns how many
    all_reduce -> add -> rms_norm it fused."""
    graph = gm.graph
    fused = 0
    for ar in list(graph.nodes):
        if ar.op != "call_function" or ar.target not in _ALL_REDUCE:
            continue
        order = {node: i for i, node in enumerate(graph.nodes)}
        found = _match(ar, order)
        if found is None:
            continue
        y, residual, weight, eps, group, add, out, erased = found
        if isinstance(eps, torch.fx.Node) and order[eps] > order[add]:
            add.prepend(eps)
        with graph.inserting_after(add):
            call = graph.call_function(torch.ops.tpcomm.custom_all_reduce_add_rms_norm.default,
                                       (y, residual, weight, eps, group))
        with graph.inserting_after(call):
            normed = graph.call_function(operator.getitem, (call, 0))
        with graph.inserting_after(normed):
            summed = graph.call_function(operator.getitem, (call, 1))
        for node, example in ((normed, out), (summed, add)):
            if "example_value" in example.meta:
                node.meta["example_value"] = example.meta["example_value"]
        out.replace_all_uses_with(normed)
        for node in erased:  # users first: each is unused once the ones after it are gone
            graph.erase_node(node)
        add.replace_all_uses_with(summed)
        graph.erase_node(add)
        graph.erase_node(ar)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
    return fused


def backend(inner="inductor"):
    """A torch.compile backend: tpcomm.compile_backend(inner), which puts
    torch's functional collectives on tpcomm and then runs this fusion."""
    from .compile_pass import compile_backend  # compile_pass imports this module

    return compile_backend(inner)
