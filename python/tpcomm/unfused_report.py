"""Says once, on logging.getLogger("tpcomm") (a warning), that a compiled
graph leaves an all-reduce unfused next to a residual add + RMSNorm, and
why, so that a user sees it without reading stats(). It reads the graph
tpcomm saw last (graph_pass.apply with report=True: after the fusion, on
the graph it last rewrites), from each tpcomm.custom_all_reduce left in it:

* graph break: the all-reduce's sum, or the add of it to another tensor,
  is returned by the graph (through views and clones) and no norm follows
  in it: the rest is in another graph (a graph break lies between them,
  Dynamo's reasons quoted), where nothing can fuse with it; said only when
  Dynamo has counted a graph break (else the sum is the model's output);
* pattern not matched: the sum's add to another tensor (or that of its
  product by a number, s * m) reaches a norm (rsqrt, rms_norm, layer_norm),
  or the sum reaches a norm whose result reaches such an add (a sandwich
  norm), yet tpcomm.fusion left it.

"Reaches" follows users for a few steps, never past a node that mixes rows
or features (a matmul, attention, an embedding) or a tpcomm op (what comes
after the fused op of another all-reduce is that one's). An all-reduce
feeding only a norm and then a matmul (the embedding's, before the first
layer's norm and attention) or a matmul alone is not reported.
"""
import logging
import operator

import torch

from . import aten_norms
from ._log import logger

_ALL_REDUCE = (torch.ops.tpcomm.custom_all_reduce, torch.ops.tpcomm.custom_all_reduce.default)
_NORMS = (torch.rsqrt, torch.ops.aten.rsqrt.default, torch.rms_norm, torch.nn.functional.rms_norm,
          torch.ops.aten.rms_norm.default, torch.nn.functional.layer_norm, torch.layer_norm,
          torch.ops.aten.layer_norm.default, torch.ops.aten.native_layer_norm.default)
_ADDS = (operator.add, operator.iadd, torch.add, torch.ops.aten.add.Tensor)
_MIXING = ("linear", "mm", "matmul", "attention", "embedding", "conv")
_LAYOUT = ("view", "reshape", "contiguous", "clone")  # methods that give their input's values
_STEPS = 12      # how far _reaches looks: a norm and the add around it span 9 nodes at most
_REASONS = 3     # Dynamo's graph break reasons quoted
_said = set()    # the kinds reported in this process


def _is_norm(node):
    return (node.op == "call_function" and node.target in _NORMS) or (node.op == "call_method"
                                                                       and node.target == "rsqrt")


def _is_tensor_add(node):
    adds = (node.op == "call_function" and node.target in _ADDS) or (node.op == "call_method"
                                                                      and node.target == "add")
    return adds and sum(isinstance(a, torch.fx.Node) for a in node.args[:2]) == 2


def _scaled(node):
    """Whether node multiplies one tensor by a number."""
    return node.op == "call_function" and node.target in (operator.mul, torch.mul) and len(node.args) == 2 \
        and sum(isinstance(a, torch.fx.Node) for a in node.args) == 1 \
        and any(isinstance(a, (int, float)) for a in node.args)


def _mixes(node):
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return any(word in str(name).lower() for word in _MIXING)


def _reaches(node, wanted, steps=_STEPS):
    """The nodes wanted(n) holds for among those node's users reach in `steps` (see the module's doc)."""
    seen, frontier = set(), [node]
    for _ in range(steps):
        frontier = [u for n in frontier for u in n.users if u not in seen and u.op in ("call_function", "call_method")
                    and not _mixes(u) and getattr(u.target, "namespace", None) not in ("tpcomm", "_tpcomm")]
        seen.update(frontier)
    return [n for n in seen if wanted(n)]


def _same_values(node):
    return (node.op == "call_method" and node.target in _LAYOUT) or aten_norms.identity(node)


def _as_is(ar):
    """ar and the nodes that give its values in another layout (views, clones), one through another."""
    found, frontier = [ar], [ar]
    while frontier:
        frontier = [u for n in frontier for u in n.users if _same_values(u)]
        found += frontier
    return found


def kinds(graph: torch.fx.Graph) -> dict:
    """{"graph break": n, "pattern not matched": n}: the all-reduces of graph
    left unfused next to an add + norm, by why (see the module's doc)."""
    found = {"graph break": 0, "pattern not matched": 0}
    for ar in graph.nodes:
        if ar.op != "call_function" or ar.target not in _ALL_REDUCE:
            continue
        sums = _as_is(ar)
        sums += [u for n in sums for u in n.users if _scaled(u)]  # the residual multiplier's s * m
        adds = [u for n in sums for u in n.users if _is_tensor_add(u)]
        norms = _reaches(ar, _is_norm)
        if any(_reaches(add, _is_norm) for add in adds) or any(_reaches(norm, _is_tensor_add) for norm in norms):
            found["pattern not matched"] += 1
        elif not norms and any(u.op == "output" for n in sums + adds for u in n.users):
            found["graph break"] += 1
    return found


def _graph_breaks():
    """The first line of each graph break reason Dynamo counted so far, at most _REASONS."""
    from torch._dynamo.utils import counters

    lines = list(dict.fromkeys(reason.strip().splitlines()[0] for reason in counters["graph_break"] if reason.strip()))
    return lines[:_REASONS]


def message(kind, breaks=()):
    """The warning for all-reduces of one kind (breaks: Dynamo's reasons)."""
    if kind == "graph break":
        text = ("tpcomm: all-reduces end compiled graphs unfused: a graph break separates each from the "
                "add + RMSNorm after it, which cannot fuse across graphs")
        if breaks:
            text += f" (Dynamo's graph breaks: {'; '.join(breaks)})"
        if any("backwards hooks" in b for b in breaks):
            text += (". Module-level backward hooks (transformers 5.3-5.21 put them on q_norm/k_norm) break it: "
                     "call tpcomm.skip_backward_hooks_without_grad(model) and run under torch.no_grad()")
        return text
    return ("tpcomm: all-reduces next to an add + RMSNorm left unfused: pattern not matched (the norm's "
            "form, its weight's dtype or shape, or a value used outside the pattern; docs/design.md, "
            "Fusion patterns, says what the pass matches)")


def report(graph: torch.fx.Graph) -> dict:
    """Logs each kind kinds(graph) finds, once per process; returns kinds(graph).
    "graph break" is said only where Dynamo counted one: without a break, a
    sum the graph returns is the model's own output (an LM head's
    all-reduce), with no norm to fuse."""
    found = kinds(graph)
    for kind, n in found.items():
        breaks = _graph_breaks() if kind == "graph break" else ()
        if n and kind not in _said and (breaks or kind != "graph break"):
            _said.add(kind)
            logger.log(logging.WARNING, message(kind, breaks))
    return found
