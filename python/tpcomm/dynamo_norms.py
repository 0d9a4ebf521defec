"""The norms tpcomm.fusion fuses, as the graph Dynamo captures writes them
(the graph AOT autograd makes: tpcomm.aten_norms). any_norm finds one on z,
of z's dtype over its last dimension, each the same math as the fused op's,
rounded once to z's dtype:

RMSNorm, n = h * rsqrt(mean(h^2) + eps), h = z.to(float32) (z.float()):
    F.rms_norm(z, (hidden,), weight, eps)        (torch.nn.RMSNorm; eps None: torch's default)
    a weight tail of n (weighted)                (Llama, Granite, Mistral, Qwen: LlamaRMSNorm's copies)
    (n * (1.0 + weight.float())).type_as(z)      (Gemma: weight_offset 1)
LayerNorm:
    F.layer_norm(z, (hidden,), weight, bias, eps)     (nn.LayerNorm; weight and bias may be None)
    F.layer_norm(z.to(float32), ...).to(z.dtype)      (OLMo)
    c = h - h.mean(-1, keepdim=True); n = c * rsqrt(c.pow(2).mean(-1, keepdim=True) + eps),
    then a weight tail of n                           (Cohere)
A weight tail (weighted), in either order of each product:
    weight * n.to(dtype)
    (weight * n).to(dtype), the weight possibly cast to fp32 first
    n.to(dtype)                                       (no weight: LayerNorm only)

eps: a float, or a symbolic float (see tpcomm.fusion) but in Gemma's form.
Each matcher returns the nodes it would erase; every one of them but z must
have no user outside the pattern (fusion checks it).
"""
import operator

import torch

from . import aten_norms

_MUL = (operator.mul, torch.mul)
_SUB = (operator.sub, torch.sub)
_LAYER_NORM = (torch.nn.functional.layer_norm, torch.layer_norm, torch.ops.aten.layer_norm.default)
_LAYER_NORM_EPS = 1e-5  # F.layer_norm's default
_RMS_NORM = (torch.rms_norm, torch.nn.functional.rms_norm, torch.ops.aten.rms_norm.default)


def example(node):
    """The tensor Dynamo (example_value) or AOT autograd (val) recorded for node, or None."""
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def is_method(node, name, *args, **kwargs):
    return (isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == name
            and tuple(node.args[1:]) == args and dict(node.kwargs) == kwargs)


def is_call(node, targets):
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def only_user(node):
    return next(iter(node.users)) if len(node.users) == 1 else None


def is_cast(node, source, dtype):
    """Whether node is source.to(dtype) (positional or dtype=), or source.float() for fp32."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_method" or not node.args or node.args[0] is not source:
        return False
    if dtype == torch.float32 and is_method(node, "float"):
        return True
    return is_method(node, "to", dtype) or is_method(node, "to", dtype=dtype)


def _other(product, node):
    """The other factor of product = node * x (either order), or None."""
    if not is_call(product, _MUL) or product.kwargs or len(product.args) != 2 or node not in product.args:
        return None
    other = product.args[1] if product.args[0] is node else product.args[0]
    return other if other is not node else None


def weighted(n, dtype, weight_optional=False):
    """A weight tail of the written norm n (see the module's doc): (weight or
    None, the node replaced, nodes erased), or None."""
    down = only_user(n)
    if down is not None and is_cast(down, n, dtype):  # weight * n.to(dtype), or none
        out = only_user(down)
        weight = _other(out, down) if out is not None else None
        if isinstance(weight, torch.fx.Node):
            return weight, out, [out, down]
        return (None, down, [down]) if weight_optional else None
    wf = _other(down, n) if down is not None else None
    out = only_user(down) if down is not None else None
    if not isinstance(wf, torch.fx.Node) or out is None or not is_cast(out, down, dtype):
        return None
    if len(wf.users) == 1 and wf.args and (is_cast(wf, wf.args[0], torch.float32)):
        return wf.args[0], out, [out, down, wf]
    return wf, out, [out, down]


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


def as_eps(value):
    """value as the fused op's eps: a float, or the node of a 0-dim float
    tensor's .item() (see the module's doc); else None."""
    if isinstance(value, float):
        return value
    if isinstance(value, torch.fx.Node) and is_method(value, "item"):
        source = example(value.args[0]) if isinstance(value.args[0], torch.fx.Node) else None
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
        if source is z and isinstance(weight, torch.fx.Node) and as_eps(eps) is not None and tuple(shape) == (hidden,):
            return weight, eps, norm, [norm]
    return None


def _normalised(z, eps_ok):
    """Each h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) of model code
    with h = z.float() (or z.to(float32)), one per user of z that starts one:
    yields (scaled, eps, the chain's nodes from scaled back to h). eps_ok(eps)
    says which eps the caller takes."""
    for up in z.users:
        if not (is_method(up, "to", torch.float32) or is_method(up, "float")) or len(up.users) != 2:
            continue
        square = next((u for u in up.users if is_method(u, "pow", 2)), None)
        scaled = next((u for u in up.users if is_call(u, (operator.mul, torch.mul))), None)
        mean = square and only_user(square)
        if scaled is None or mean is None or not (is_method(mean, "mean", -1, keepdim=True)
                                                  or is_method(mean, "mean", -1, True)):
            continue
        plus = only_user(mean)
        if plus is None or not is_call(plus, (operator.add, torch.add)) or plus.args[0] is not mean \
                or not eps_ok(plus.args[1]) or plus.kwargs:
            continue
        root = only_user(plus)
        if root is None or not is_call(root, (torch.rsqrt,)) or only_user(root) is not scaled \
                or set(scaled.args) != {up, root} or scaled.kwargs:
            continue
        yield scaled, plus.args[1], [scaled, root, plus, mean, square, up]


def _written_norm(z, dtype):
    """The norm of Llama-style model code (Hugging Face's LlamaRMSNorm and its
    copies) on z: h * rsqrt(mean(h^2) + eps) (_normalised), then a weight
    tail (weighted: the weight before or after the cast back to
    z's dtype). (weight, eps, the node to replace, the nodes to erase), or
    None."""
    for scaled, eps, chain in _normalised(z, lambda e: as_eps(e) is not None):
        tail = weighted(scaled, dtype)
        if tail is not None:
            weight, out, erased = tail
            return weight, eps, out, erased + chain
    return None


def _gemma_norm(z):
    """The norm of Gemma-style model code on z: h * rsqrt(mean(h^2) + eps)
    (_normalised) times (1.0 + weight.float()), .type_as(z). (weight, eps, the
    node to replace, the nodes to erase), or None."""
    for scaled, eps, chain in _normalised(z, lambda e: isinstance(e, float)):
        times = only_user(scaled)
        if times is None or not is_call(times, (operator.mul, torch.mul)) or times.args[0] is not scaled \
                or times.kwargs:
            continue
        offset = times.args[1]
        if not (isinstance(offset, torch.fx.Node) and is_call(offset, (operator.add, torch.add))
                and offset.args[0] == 1.0 and len(offset.users) == 1 and not offset.kwargs):
            continue
        wf = offset.args[1]
        if not (isinstance(wf, torch.fx.Node) and is_method(wf, "float") and len(wf.users) == 1):
            continue
        out = only_user(times)
        if out is None or not (out.op == "call_method" and out.target == "type_as" and out.args == (times, z)):
            continue
        return wf.args[0], eps, out, [out, times, offset, wf] + chain
    return None


def any_norm(z, dtype, hidden):
    """(kind "rms" or "layer", weight, bias, eps, weight_offset, node replaced,
    nodes erased) of a norm of z (of dtype, over its last dimension of size
    hidden) in Dynamo's graph or AOT's (aten_norms), or None. The weight's
    and bias's dtype and shape are the caller's to check."""
    found = _functional_norm(z, dtype, hidden) or _written_norm(z, dtype)
    if found is not None:
        return ("rms", found[0], None, found[1], 0.0) + found[2:]
    found = _gemma_norm(z)
    if found is not None:
        return ("rms", found[0], None, found[1], 1.0) + found[2:]
    found = aten_norms.find(z, dtype)
    if found is not None:
        return ("rms", found[0], None) + found[1:]
    found = layer_norm(z, dtype, hidden) or aten_norms.layer_norm(z, dtype, hidden)
    if found is not None:
        weight, bias, eps, out, erased = found
        return "layer", weight, bias, eps, 0.0, out, erased
    return None


def _layer_norm_args(node):
    """(input, normalized_shape, weight, bias, eps) of a layer_norm call, or None."""
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    values = {"weight": None, "bias": None, "eps": _LAYER_NORM_EPS}
    values.update(zip(names, node.args))
    values.update({k: v for k, v in node.kwargs.items() if k in names})
    if set(values) != set(names) or len(node.args) > len(names) or set(node.kwargs) - set(names):
        return None
    return tuple(values[n] for n in names)


def _functional(z, dtype, hidden):
    """F.layer_norm of z, or of z.to(float32) cast back to dtype."""
    starts = [(z, [])] + [(up, [up]) for up in z.users if is_cast(up, z, torch.float32) and len(up.users) == 1]
    for source, erased in starts:
        for norm in source.users:
            args = is_call(norm, _LAYER_NORM) and _layer_norm_args(norm)
            if not args or args[0] is not source or tuple(args[1]) != (hidden,) or as_eps(args[4]) is None:
                continue
            _, _, weight, bias, eps = args
            if source is not z:  # cast up: the norm's only user casts back
                out = only_user(norm)
                if out is None or not is_cast(out, norm, dtype):
                    continue
                return weight, bias, eps, out, [out, norm] + erased
            return weight, bias, eps, norm, [norm]
    return None


def _centred(z):
    """Each c * rsqrt(mean(c^2) + eps), c = h - h.mean(-1, keepdim=True), h =
    z.to(float32), as written: (n, eps, the nodes from n back to h)."""
    for up in z.users:
        if not is_cast(up, z, torch.float32):
            continue
        means = [u for u in up.users if is_method(u, "mean", -1, keepdim=True) or is_method(u, "mean", -1, True)]
        if len(means) != 1:
            continue
        mean = means[0]
        subs = [u for u in up.users if u is not mean]
        if not subs or set(mean.users) != set(subs) or any(
                not is_call(s, _SUB) or tuple(s.args) != (up, mean) or s.kwargs for s in subs):
            continue
        for square in (u for s in subs for u in s.users if is_method(u, "pow", 2)):
            var = only_user(square)
            plus = var and only_user(var)
            root = plus and only_user(plus)
            if not (is_method(var, "mean", -1, keepdim=True) or is_method(var, "mean", -1, True)) \
                    or not is_call(plus, (operator.add, torch.add)) or plus.args[0] is not var \
                    or as_eps(plus.args[1]) is None or not is_call(root, (torch.rsqrt,)):
                continue
            n = only_user(root)
            c = _other(n, root) if n is not None else None
            if c in subs and all(set(s.users) <= {square, n} for s in subs):
                yield n, plus.args[1], [n, root, plus, var, square] + subs + [mean, up]


def layer_norm(z, dtype, hidden):
    """(weight or None, bias or None, eps, the node replaced, nodes erased) of
    a LayerNorm of z over its last dimension (of size hidden), or None."""
    found = _functional(z, dtype, hidden)
    if found is not None:
        return found
    for n, eps, chain in _centred(z):
        tail = weighted(n, dtype, weight_optional=True)
        if tail is not None:
            weight, out, erased = tail
            return weight, None, eps, out, erased + chain
    return None
