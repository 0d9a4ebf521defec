"""tpcomm's rewrite of an FX graph, what tpcomm.compile_backend and
tpcomm.inductor_pass.TpcommPass run (apply): torch's functional collectives
put on tpcomm, then the add + RMSNorm fusion (tpcomm.fusion) and its FP8
quantization (tpcomm.fusion_fp8), then the report of all-reduces left
unfused (tpcomm.unfused_report).

Dynamo traces torch.distributed's calls as functional collectives, each
followed by its wait (torch.distributed._functional_collectives,
traceable_collective_remaps). In the graph, on a group that has an open
tpcomm Communicator in this process when the graph is compiled:

    _c10d_functional.all_reduce(x, "sum", group) + wait_tensor           -> tpcomm.custom_all_reduce(x, group)
    _c10d_functional.all_gather_into_tensor(x, n, group) + wait_tensor   -> tpcomm.custom_all_gather(x, 0, group)
    _c10d_functional.reduce_scatter_tensor(x, "sum", n, group) + wait    -> tpcomm.custom_reduce_scatter(x, 0, group)

Each pair is rewritten only where tpcomm's op gives the same tensor: the
reduce op is "sum", n is the Communicator's world size, and the wait is
the only user of the collective's result with nothing but views and empty
allocations between them (a collective whose wait comes after other work
overlaps that work: an async use, left as it is). tpcomm's op goes where
the collective was, so it reads its input when the collective did. Other
groups, other reduce ops and other collectives are left as they are. Then
the in-place copy Dynamo writes for dist.all_reduce (x.copy_(result)) is
dropped where that is provably the same (see _drop_copy), and the residual
add + RMSNorm after an all_reduce is fused (tpcomm.fusion).

After AOT autograd the graph is functional (no copies) and the norm is
decomposed into aten ops: there the collectives are rewritten and the
fusion matches the norm in that form (tpcomm.aten_norms).

The in-place forms (_c10d_functional.all_reduce_ and the like) are left as
they are: Dynamo and AOT write the functional forms, and inductor makes them
in-place only after its custom passes (reinplace_inplaceable_ops). Which
groups go to tpcomm is decided when a graph is compiled: the graph then
calls the group-name ops, which raise once that group has no open
Communicator. Under torch.compile(dynamic=True) the fusion matches too
(tpcomm.fusion says how it takes the eps Dynamo then passes).
"""
import operator

import torch

from . import _registry, fusion, fusion_fp8, ops, parallel_merge, unfused_report  # noqa: F401 - ops: torch.ops.tpcomm.*
from .norm_patterns import STATS_KEY

_F = torch.ops._c10d_functional
_ALL_REDUCE = (_F.all_reduce, _F.all_reduce.default)
_ALL_GATHER = (_F.all_gather_into_tensor, _F.all_gather_into_tensor.default)
_REDUCE_SCATTER = (_F.reduce_scatter_tensor, _F.reduce_scatter_tensor.default)
_WAIT = (_F.wait_tensor, _F.wait_tensor.default)
# The node meta a replacement takes over from the wait it replaces: the
# value Dynamo (example_value) or AOT (val, tensor_meta) recorded, and where
# it comes from in the model's source.
_KEPT_META = ("example_value", "val", "tensor_meta", "stack_trace", "nn_module_stack")

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# the collectives, then the fusion patterns, then those patterns with their FP8 quantization, then the
# parallel blocks' pairs of all-reduces made one
COUNTED = COLLECTIVES + tuple(STATS_KEY.values()) + tuple(fusion_fp8.COUNT_KEY.values()) + (parallel_merge.STATS_KEY,)


def _bound(node, names):
    """node's arguments by the schema's names, or None if any is missing."""
    values = dict(zip(names, node.args))
    values.update({k: v for k, v in node.kwargs.items() if k in names})
    if len(node.args) > len(names) or set(values) != set(names):
        return None
    return tuple(values[n] for n in names)


def _replacement(node):
    """(collective, tpcomm target, its args) for a functional collective
    that tpcomm computes identically on a group with an open Communicator,
    or None."""
    if node.op != "call_function":
        return None
    if node.target in _ALL_REDUCE:
        found = _bound(node, ("input", "reduce_op", "group_name"))
        if found is None or found[1] != "sum":
            return None
        x, _, name = found
        size, what, target, args = None, "all_reduce", torch.ops.tpcomm.custom_all_reduce.default, (x, name)
    elif node.target in _ALL_GATHER:
        found = _bound(node, ("input", "group_size", "group_name"))
        if found is None:
            return None
        x, size, name = found
        what, target, args = "all_gather", torch.ops.tpcomm.custom_all_gather.default, (x, 0, name)
    elif node.target in _REDUCE_SCATTER:
        found = _bound(node, ("input", "reduce_op", "group_size", "group_name"))
        if found is None or found[1] != "sum":
            return None
        x, _, size, name = found
        what, target, args = "reduce_scatter", torch.ops.tpcomm.custom_reduce_scatter.default, (x, 0, name)
    else:
        return None
    comm = _registry.find(name) if isinstance(name, str) else None
    if comm is None or (size is not None and size != comm.world_size):
        return None
    value = _value(x)
    if what != "all_reduce" and value is not None and (
            value.dim() == 0 or (what == "reduce_scatter" and isinstance(value.shape[0], int)
                                 and value.shape[0] % comm.world_size)):
        return None  # tpcomm's op takes neither; torch's says why
    return what, target, args


# What may lie between a collective and its wait without making it an async
# use: no arithmetic that the collective could overlap, only views of other
# tensors, new empty ones and dtype casts (AOT and inductor's post-grad
# passes place such nodes there, e.g. a cast of the rotary tables).
_NO_WORK = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
            torch.ops.aten.empty_strided.default, torch.ops.prims.convert_element_type.default,
            torch.ops.aten._to_copy.default)


def _no_work(node):
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and (node.target.is_view or node.target in _NO_WORK)


def _synchronous_wait(node):
    """The wait_tensor of `node` if it is the only user of its result and
    nothing but views and allocations lies between them, else None."""
    if len(node.users) != 1:
        return None
    (wait,) = node.users
    if wait.op != "call_function" or wait.target not in _WAIT or wait.args != (node,) or wait.kwargs:
        return None
    between = node.next
    while between is not wait:
        if not _no_work(between):
            return None
        between = between.next
    return wait


def _value(node):
    """The tensor Dynamo or AOT recorded for node, or None."""
    for key in ("example_value", "val"):
        value = node.meta.get(key) if isinstance(node, torch.fx.Node) else None
        if isinstance(value, torch.Tensor):
            return value
    return None


def _drop_copy(graph, result):
    """Dynamo traces dist.all_reduce(x) as `x.copy_(all_reduce(x))` and
    later reads of x; dist.all_gather_into_tensor(out, x) likewise copies
    into out. Where that copy's destination is a fresh tensor made in the
    graph (not an input, not a view of another tensor, contiguous, of the
    result's shape and dtype) and nothing uses it between the collective
    and the copy (so no alias of it exists that a later read could go
    through), its later users read the collective's result instead and the
    copy goes: what the fusion then matches. Tensors sharing dst's storage
    (a detach, a tensor dst views) keep it. Returns whether it dropped one."""
    copy = next((u for u in result.users if u.op == "call_method" and u.target == "copy_"
                 and len(u.args) == 2 and u.args[1] is result and not u.kwargs), None)
    if copy is None:
        return False
    dst = copy.args[0]
    if not isinstance(dst, torch.fx.Node) or dst.op not in ("call_function", "call_method"):
        return False
    before, after = _value(dst), _value(result)
    if before is None or after is None or before._is_view() or not before.is_contiguous() \
            or before.shape != after.shape or before.dtype != after.dtype or before.device != after.device:
        return False
    others = [u for u in dst.users if u is not copy and u is not result]
    order = {node: i for i, node in enumerate(graph.nodes)}
    if any(order[u] < order[copy] for u in others) or _aliased(graph, dst, before):
        return False
    for user in others:
        user.replace_input_with(dst, result)
    copy.replace_all_uses_with(result)
    graph.erase_node(copy)
    return True


def _storage(value):
    return value.untyped_storage()._cdata


def _aliased(graph, dst, value):
    """Whether a node other than dst and its users holds a tensor sharing
    dst's storage (x.detach() or a view dst was taken from, say) that is
    read after dst: a node whose every use leads only into dst (MoE code's
    `out = h.to(dtype)`, the same tensor as h, all-reduced in place) is
    read before the copy, never through it."""
    storage = _storage(value)
    into_dst = {dst}
    for node in reversed(graph.nodes):
        if node.users and all(u in into_dst for u in node.users):
            into_dst.add(node)
    for node in graph.nodes:
        other = _value(node)
        if node not in into_dst and dst not in node.all_input_nodes and other is not None \
                and _storage(other) == storage:
            return True
    return False


def rewrite_collectives(graph: torch.fx.Graph) -> dict:
    """Rewrites graph in place (see the module's doc); returns how many of
    each collective it put on tpcomm: {"all_reduce": n, "all_gather": n,
    "reduce_scatter": n}."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for node in list(graph.nodes):
        found = _replacement(node)
        wait = _synchronous_wait(node) if found else None
        if wait is None:
            continue
        what, target, args = found
        with graph.inserting_before(node):
            call = graph.call_function(target, args)
        call.meta.update({k: wait.meta[k] for k in _KEPT_META if k in wait.meta})
        wait.replace_all_uses_with(call)
        graph.erase_node(wait)
        graph.erase_node(node)
        _drop_copy(graph, call)
        counts[what] += 1
    if any(counts.values()):
        graph.lint()
    return counts


def apply(graph: torch.fx.Graph, counts: dict, fuse: bool = True, report: bool = True) -> None:
    """rewrite_collectives, then (with fuse, where the graph's module is a
    GraphModule) the parallel blocks' all-reduces merged
    (tpcomm.parallel_merge), the add + norm fusion and its FP8 quantization
    (tpcomm.fusion_fp8); adds what they rewrote into counts (keys COUNTED:
    a fused call with its quantization counts under the pattern's "_fp8"
    key, not the pattern's). With fuse and report, all-reduces left unfused
    next to an add + norm are reported (unfused_report): report=False where
    a later pass sees the graph again."""
    for what, n in rewrite_collectives(graph).items():
        counts[what] += n
    module = graph.owning_module
    if fuse and isinstance(module, torch.fx.GraphModule):
        # before the fusion, which fuses the one all-reduce left with its add and norm
        counts[parallel_merge.STATS_KEY] += parallel_merge.merge(graph)
        for key, n in fusion.fuse(module).items():
            counts[key] += n
        # after the norm fusion, whose fused calls it extends: a call it rewrites moves to its _fp8 key
        for key, n in fusion_fp8.fuse(module).items():
            counts[key] += n
        module.recompile()
        if report:
            unfused_report.report(graph)
