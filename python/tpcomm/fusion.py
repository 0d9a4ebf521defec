"""A torch.compile pass that puts a model's residual add and RMSNorm into the
all-reduce, so models need no edit to use the fused op:

    compiled = torch.compile(model, backend=tpcomm.fusion.backend())            # inductor after the pass
    compiled = torch.compile(model, backend=tpcomm.fusion.backend("aot_eager"))

In the graph Dynamo captures, every

    z = residual + torch.ops.tpcomm.all_reduce(y, group_name)      (either order of the add)
    h = torch.nn.functional.rms_norm(z, (hidden,), weight, eps)      (torch.nn.RMSNorm calls it)

becomes h, z = torch.ops.tpcomm.all_reduce_add_rms_norm(y, residual, weight,
eps, group_name), where the shapes and dtypes Dynamo recorded allow it: y and
residual of one shape and dtype, weight of that dtype and of the last
dimension's length, an explicit weight and eps, and the all-reduce used only
by the add (its result is not kept). Other users of z take the fused op's z.
What does not match is left as it is. The fused op computes in fp32 from the
sum to the norm and rounds once, where the unfused model rounds z first: the
normed values can differ from the model's in the last bit.

Hand-written norms (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
are not matched: they have many spellings; write them with F.rms_norm or
call Communicator.all_reduce_add_rms_norm.
"""
import operator

import torch

from . import ops  # noqa: F401 - registers torch.ops.tpcomm.all_reduce and the fused op

_ALL_REDUCE = (torch.ops.tpcomm.all_reduce, torch.ops.tpcomm.all_reduce.default)
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


def _match(ar, order):
    """The nodes of one all_reduce -> add -> rms_norm, or None."""
    if len(ar.users) != 1:
        return None
    (add,) = ar.users
    if add.op != "call_function" or add.target not in _ADD or add.kwargs or len(add.args) != 2:
        return None
    residual = add.args[1] if add.args[0] is ar else add.args[0]
    if residual is ar or not isinstance(residual, torch.fx.Node):
        return None
    for norm in add.users:
        if norm.op != "call_function" or norm.target not in _RMS_NORM:
            continue
        args = _norm_args(norm)
        if args is None:
            continue
        z, shape, weight, eps = args
        if z is not add or not isinstance(weight, torch.fx.Node) or not isinstance(eps, float):
            continue
        if order[weight] > order[add]:  # the fused op goes where the add is: its inputs must exist there
            continue
        y = ar.args[0] if len(ar.args) > 0 else ar.kwargs.get("x")
        group = ar.args[1] if len(ar.args) > 1 else ar.kwargs.get("group_name")
        ty, tr, tw = _example(y), _example(residual), _example(weight)
        if ty is None or tr is None or tw is None or not isinstance(group, str):
            continue
        if (ty.shape != tr.shape or ty.dtype != tr.dtype or tw.dtype != ty.dtype or ty.dim() < 1
                or tuple(tw.shape) != (ty.shape[-1],) or tuple(shape) != (ty.shape[-1],)):
            continue
        return y, residual, weight, eps, group, add, norm
    return None


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
        y, residual, weight, eps, group, add, norm = found
        with graph.inserting_after(add):
            call = graph.call_function(torch.ops.tpcomm.all_reduce_add_rms_norm.default,
                                       (y, residual, weight, eps, group))
        with graph.inserting_after(call):
            normed = graph.call_function(operator.getitem, (call, 0))
        with graph.inserting_after(normed):
            summed = graph.call_function(operator.getitem, (normed.args[0], 1))
        for node, example in ((normed, norm), (summed, add)):
            if "example_value" in example.meta:
                node.meta["example_value"] = example.meta["example_value"]
        norm.replace_all_uses_with(normed)
        add.replace_all_uses_with(summed)
        graph.erase_node(norm)
        graph.erase_node(add)
        graph.erase_node(ar)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
    return fused


def backend(inner="inductor"):
    """A torch.compile backend: the pass, then the backend named `inner`."""
    def compile_fn(gm, example_inputs):
        fuse_all_reduce_add_rms_norm(gm)
        return torch._dynamo.lookup_backend(inner)(gm, example_inputs)
    return compile_fn
