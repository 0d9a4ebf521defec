"""The parallel block's two all-reduces made one, for the compile pass
(tpcomm.graph_pass runs it before tpcomm.fusion, which then fuses the one
all-reduce with the residual add and norm as usual).

A parallel block (GPT-J, GPT-NeoX, Cohere, Phi-2 style) runs attention and
the MLP on the same normed input; each ends in a row-parallel linear, whose
partial sums torch code all-reduces separately, and the two sums are added
to the residual. The all-reduce is linear, so where two all-reduces' results
(each through identities: tpcomm.fusion._through_identities) are used only
by that addition, in the graph Dynamo captures:

    all_reduce(y1) + all_reduce(y2)                       (either order)
        -> all_reduce(y1 + y2)
    (r + all_reduce(y1)) + all_reduce(y2)                 (the inner add used only there; any order)
        -> r + all_reduce(y1 + y2)

one all-reduce of the same group and dtype runs in place of two, where the
addition was. This changes the arithmetic (docs/design.md, "Parallel-residual
merge", states the bound): each rank's y1 + y2 is rounded to the model's
dtype before the fp32 sum over ranks, and the ranks' terms are summed in
another order. So it runs only under the compile pass with fusion on.
"""
import operator

import torch

from .dynamo_norms import example, only_user
from .fusion import _ADD, _ALL_REDUCE, _erase, _identity, _reapplied, _through_identities

STATS_KEY = "all_reduce_merged"  # the pass's count of pairs merged (compile_backend.counts)


def _reduced(node, group=None):
    """(all_reduce, y, its identity chain) where node is the end of an
    all-reduce's chain of identities, of `group` if given; else None."""
    ar = node
    while isinstance(ar, torch.fx.Node) and not _is_all_reduce(ar) and _identity(ar):
        ar = ar.args[0]
    if not isinstance(ar, torch.fx.Node) or not _is_all_reduce(ar):
        return None
    end, chain = _through_identities(ar)
    y = ar.args[0] if ar.args else ar.kwargs.get("x")
    name = _group(ar)
    if end is not node or not isinstance(name, str) or (group is not None and name != group) \
            or example(y) is None or example(node) is None:
        return None
    return ar, y, chain


def _is_all_reduce(node):
    return node.op == "call_function" and node.target in _ALL_REDUCE


def _group(ar):
    return ar.args[1] if len(ar.args) > 1 else ar.kwargs.get("group_name")


def _is_add(node):
    return node.op == "call_function" and node.target in _ADD and not node.kwargs and len(node.args) == 2 \
        and all(isinstance(a, torch.fx.Node) for a in node.args) and node.args[0] is not node.args[1]


def _pair(add):
    """(reduced 1, reduced 2, the residual or None, nodes erased with the ARs)
    for an add of the merged forms (see the module's doc), or None."""
    if not _is_add(add):
        return None
    for first, second in (add.args, add.args[::-1]):
        one, residual, inner = _reduced(first), None, []
        if one is None and _is_add(first) and only_user(first) is add:  # (r + ar1) + ar2
            for a, r in (first.args, first.args[::-1]):
                one = _reduced(a)
                if one is not None:
                    residual, inner = r, [first]
                    break
        if one is None:
            continue
        two = _reduced(second, _group(one[0]))
        if two is None or one[0] is two[0]:
            continue
        ends = (one[2][-1] if one[2] else one[0], two[2][-1] if two[2] else two[0])
        values = [example(e) for e in ends] + [example(one[1]), example(two[1])]
        if any(v.dtype != values[0].dtype for v in values) or values[0].shape != values[1].shape \
                or only_user(ends[0]) not in (add, first) or only_user(ends[1]) is not add \
                or any(len(n.users) != 1 for n in [one[0], two[0]] + one[2] + two[2]):
            continue
        return one, two, residual, inner
    return None


def merge(graph: torch.fx.Graph) -> int:
    """Rewrites graph in place (see the module's doc); returns how many
    pairs of all-reduces it made one."""
    merged = 0
    for add in list(graph.nodes):
        if add.graph is not graph:
            continue  # erased by an earlier merge
        found = _pair(add)
        if found is None:
            continue
        (ar1, y1, chain1), (ar2, y2, chain2), residual, inner = found
        y1, y2 = _reapplied(graph, y1, chain1), _reapplied(graph, y2, chain2)
        plus = operator.add if add.target in (operator.add, operator.iadd, torch.add) else torch.ops.aten.add.Tensor
        meta = {k: add.meta[k] for k in ("example_value", "val") if k in add.meta}
        with graph.inserting_before(add):
            local = graph.call_function(plus, (y1, y2))
            reduced = graph.call_function(ar2.target, (local,) + tuple(ar2.args[1:]), dict(ar2.kwargs))
            out = reduced if residual is None else graph.call_function(plus, (residual, reduced))
        for node in (local, reduced, out):
            node.meta.update(meta)
        add.replace_all_uses_with(out)
        _erase(graph, [add] + inner + chain1 + chain2 + [ar1, ar2])
        merged += 1
    if merged:
        graph.lint()
    return merged
