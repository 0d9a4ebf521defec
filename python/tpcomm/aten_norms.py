"""The RMSNorm as AOT autograd writes it, for tpcomm.fusion: the graph
inductor's post-grad pass and aot_eager's forward compiler see, where the
model's norm is decomposed into aten ops. There an all-reduce that Dynamo's
graph did not show (DTensor's redistribute of a row-parallel layer's Partial
output, transformers 4.x) meets its add and norm: fusion.fuse matches the
same patterns on both graphs, through find() and identity() here.

The norm of z (dtype d, fp32 where d is fp32 and no cast appears):

    h = cast(z, fp32)                        # absent when d is fp32
    r = rsqrt(mean(pow(h, 2), [-1], keepdim=True) + eps)
    Llama-style:  weight * cast(h * r, d)    # the cast absent when d is fp32
    Gemma-style:  cast((h * r) * (cast(weight, fp32) + 1.0), d)

casts being aten._to_copy (dtype only, or the input's own layout and
device: aot_eager) or prims.convert_element_type (inductor), a product in
either order. A LayerNorm (layer_norm): aten.native_layer_norm's first
output, as aot_eager writes F.layer_norm, on z or z cast to fp32 and cast
back, or as inductor decomposes it (var_mean; _decomposed), or model
code's LayerNorm in aten ops (Cohere's). Every node of the chain but
z must have no user outside it, so that the rewrite can remove the chain
whole.
"""
import operator

import torch

_A = torch.ops.aten
_ADD = (_A.add.Tensor, _A.add.Scalar)
_MUL = (_A.mul.Tensor,)
# Value-preserving nodes between an all-reduce and its consumer that keep its shape
_SAME_SHAPE = (_A.clone.default, _A.alias.default, _A.view.default, _A._unsafe_view.default, _A.reshape.default)


def _value(node):
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _call(node, targets):
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _only_user(node):
    return next(iter(node.users)) if len(node.users) == 1 else None


def _cast_to(node, source, dtype):
    """Whether node is `source` cast to dtype (and nothing else)."""
    if _call(node, (torch.ops.prims.convert_element_type.default,)):
        return tuple(node.args) == (source, dtype) and not node.kwargs
    if not _call(node, (_A._to_copy.default,)) or tuple(node.args) != (source,):
        return False
    kwargs, before = dict(node.kwargs), _value(source)
    if kwargs.pop("dtype", None) != dtype or kwargs.pop("layout", torch.strided) != torch.strided:
        return False
    device = kwargs.pop("device", None)
    return not kwargs and (device is None or (before is not None and torch.device(device) == before.device))


def _upcast(z, dtype):
    """(h, its node to erase or None): z itself where dtype is fp32, else z's
    one cast to fp32 whose only users are the square and the product."""
    if dtype == torch.float32:
        yield z, None
        return
    for up in z.users:
        if _cast_to(up, z, torch.float32) and len(up.users) == 2:
            yield up, up


def _product(node, a, b):
    """Whether node is a * b in either order."""
    return _call(node, _MUL) and not node.kwargs and len(node.args) == 2 and set(node.args) == {a, b} and a is not b


def _last_dim_kept(mean, h):
    """Whether aten.mean.dim `mean` reduces h's last dimension alone, keeping it."""
    dims = mean.args[1] if len(mean.args) > 1 else None
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    last = h.dim() - 1 if h is not None else -1
    return isinstance(dims, (list, tuple)) and list(dims) in ([-1], [last]) and keepdim is True \
        and set(mean.kwargs) <= {"keepdim"}


def _normalised(z, dtype):
    """Each h * rsqrt(mean(h^2) + eps) of z: (scaled, eps, the chain's nodes to erase)."""
    for h, up in _upcast(z, dtype):
        for square in list(h.users):
            if not (_call(square, (_A.pow.Tensor_Scalar,)) and tuple(square.args) == (h, 2) and len(square.users) == 1):
                continue
            mean = _only_user(square)
            if not (_call(mean, (_A.mean.dim,)) and mean.args[0] is square and len(mean.users) == 1
                    and _last_dim_kept(mean, _value(h))):
                continue
            plus = _only_user(mean)
            if not (_call(plus, _ADD) and plus.args[0] is mean and isinstance(plus.args[1], float)
                    and not plus.kwargs and len(plus.users) == 1):
                continue
            root = _only_user(plus)
            if not (_call(root, (_A.rsqrt.default,)) and len(root.users) == 1):
                continue
            scaled = _only_user(root)
            if _product(scaled, h, root) and len(scaled.users) == 1:
                yield scaled, plus.args[1], [scaled, root, plus, mean, square] + ([up] if up is not None else [])


def _to_dtype(node, dtype, output):
    """node's one user casting it to dtype, or node itself when dtype is fp32;
    or None. Only an output (the node replaced) may have other users."""
    if dtype == torch.float32:
        return node
    down = _only_user(node)
    return down if _cast_to(down, node, dtype) and (output or len(down.users) == 1) else None


def _llama(scaled, dtype):
    """weight * cast(scaled, dtype): (weight, the node replaced, nodes erased), or None."""
    down = _to_dtype(scaled, dtype, output=False)
    out = down and _only_user(down)
    if out is None or not _call(out, _MUL) or out.kwargs or len(out.args) != 2 or down not in out.args:
        return None
    weight = out.args[1] if out.args[0] is down else out.args[0]
    if not isinstance(weight, torch.fx.Node) or weight is down:
        return None
    return weight, out, [out] + ([down] if down is not scaled else [])


def _gemma(scaled, dtype):
    """cast(scaled * (cast(weight, fp32) + 1.0), dtype): (weight, the node
    replaced, nodes erased), or None."""
    times = _only_user(scaled)
    if times is None or not _call(times, _MUL) or times.kwargs or len(times.args) != 2 or scaled not in times.args:
        return None
    offset = times.args[1] if times.args[0] is scaled else times.args[0]
    if not (_call(offset, _ADD) and len(offset.args) == 2 and offset.args[1] == 1.0 and not offset.kwargs
            and len(offset.users) == 1 and isinstance(offset.args[0], torch.fx.Node)):
        return None
    wf = offset.args[0]
    if dtype == torch.float32:
        weight, erased = wf, [times, offset]
    elif _call(wf, (_A._to_copy.default, torch.ops.prims.convert_element_type.default)) \
            and _cast_to(wf, wf.args[0], torch.float32) and len(wf.users) == 1:
        weight, erased = wf.args[0], [times, offset, wf]
    else:
        return None
    out = _to_dtype(times, dtype, output=True)
    if out is None:
        return None
    return weight, out, ([out] if out is not times else []) + erased


def find(z, dtype):
    """(weight, eps, weight_offset, node replaced, nodes erased) of an RMSNorm
    of z (of dtype, over its last dimension) in AOT's aten form, or None.
    The weight's dtype and shape are the caller's to check."""
    for scaled, eps, chain in _normalised(z, dtype):
        for offset, form in ((1.0, _gemma), (0.0, _llama)):  # Gemma's first: its w + 1 is a weight to _llama
            found = form(scaled, dtype)
            if found is not None:
                weight, out, erased = found
                return weight, eps, offset, out, erased + chain
    return None


def identity(node):
    """Whether node gives its first argument's values in its shape (a clone,
    an alias, a view to the same shape): nothing fusion must reapply."""
    if not _call(node, _SAME_SHAPE) or not node.args:
        return False
    if node.target is _A.clone.default and node.kwargs.get("memory_format", torch.preserve_format) \
            not in (torch.preserve_format, torch.contiguous_format):
        return False
    before, after = _value(node.args[0]), _value(node)
    return before is not None and after is not None and tuple(before.shape) == tuple(after.shape)


def _centred(z, dtype):
    """Each c * rsqrt(mean(c^2) + eps), c = h - mean(h) (h as in _upcast; a
    sub AOT may have kept twice): (n, eps, the chain's nodes to erase)."""
    ups = [(z, None)] if dtype == torch.float32 else [(u, u) for u in z.users if _cast_to(u, z, torch.float32)]
    for h, up in ups:
        means = [u for u in h.users if _call(u, (_A.mean.dim,)) and u.args[0] is h and _last_dim_kept(u, _value(h))]
        for mean in means:
            subs = list(mean.users)
            if not subs or any(not _call(c, (_A.sub.Tensor,)) or tuple(c.args) != (h, mean) or c.kwargs for c in subs) \
                    or (up is not None and set(up.users) != {mean, *subs}):
                continue
            for square in [u for c in subs for u in c.users if _call(u, (_A.pow.Tensor_Scalar,)) and u.args[1] == 2]:
                var = _only_user(square)
                plus = var and _only_user(var)
                root = plus and _only_user(plus)
                if not (_call(var, (_A.mean.dim,)) and _last_dim_kept(var, _value(square)) and _call(plus, _ADD)
                        and plus.args[0] is var and isinstance(plus.args[1], float)
                        and _call(root, (_A.rsqrt.default,))):
                    continue
                n = _only_user(root)
                if any(_product(n, c, root) for c in subs) and all(set(c.users) <= {square, n} for c in subs):
                    yield n, plus.args[1], [n, root, plus, var, square] + subs + [mean] + ([up] if up else [])


def _weighted(n, dtype):
    """A LayerNorm's weight tail on n: cast(w32 * n, dtype), w32 the weight
    cast to fp32 (Cohere), w * cast(n, dtype) (_llama) or cast(n, dtype)
    alone: (weight or None, the node replaced, nodes erased), or None."""
    times = _only_user(n)
    if _call(times, _MUL) and not times.kwargs and len(times.args) == 2 and n in times.args:
        wf = times.args[1] if times.args[0] is n else times.args[0]
        out = _to_dtype(times, dtype, output=True)
        if isinstance(wf, torch.fx.Node) and wf is not n and out is not None:
            erased = [times] + ([out] if out is not times else [])
            if _cast_to(wf, wf.args[0] if wf.args else None, torch.float32) and len(wf.users) == 1:
                return wf.args[0], out, erased + [wf]
            return wf, out, erased
    found = _llama(n, dtype)
    if found is not None:
        return found
    down = _to_dtype(n, dtype, output=True)
    return (None, down, [down]) if down is not None and down is not n else None


def _decomposed(z, dtype):
    """The LayerNorm inductor's decomposition writes (before its post-grad pass):
    h = cast(z, fp32); var, mean = var_mean(h, [-1], correction=0, keepdim=True);
    n = (h - mean) * rsqrt(var + eps) [* weight] [+ bias], cast to dtype.
    (weight or None, bias or None, eps, node replaced, nodes erased), or None."""
    ups = [(z, None)] if dtype == torch.float32 else [(u, u) for u in z.users if _cast_to(u, z, torch.float32)]
    for h, up in ups:
        for vm in [u for u in h.users if _call(u, (_A.var_mean.correction,)) and u.args[0] is h]:
            value = _value(h)
            last_dim = [-1] + ([value.dim() - 1] if value is not None else [])
            if dict(vm.kwargs) != {"correction": 0, "keepdim": True} or len(vm.args) != 2 \
                    or not isinstance(vm.args[1], (list, tuple)) or len(vm.args[1]) != 1 \
                    or vm.args[1][0] not in last_dim or len(vm.users) != 2:
                continue
            parts = {g.args[1]: g for g in vm.users if _call(g, (operator.getitem,)) and len(g.users) == 1}
            if set(parts) != {0, 1}:
                continue
            var, mean = parts[0], parts[1]
            sub, plus = _only_user(mean), _only_user(var)
            root = _only_user(plus) if _call(plus, _ADD) else None
            n = _only_user(root) if _call(root, (_A.rsqrt.default,)) else None
            if not (_call(sub, (_A.sub.Tensor,)) and tuple(sub.args) == (h, mean) and not sub.kwargs
                    and plus.args[0] is var and isinstance(plus.args[1], float) and n is not None
                    and _product(n, sub, root) and len(sub.users) == 1
                    and (up is None or set(up.users) == {vm, sub})):
                continue
            chain = [n, root, plus, var, mean, sub, vm] + ([up] if up is not None else [])
            last, params = n, {}
            for name, ops in (("weight", _MUL), ("bias", _ADD)):
                user = _only_user(last)
                if _call(user, ops) and not user.kwargs and len(user.args) == 2 and last in user.args:
                    other = user.args[1] if user.args[0] is last else user.args[0]
                    if other is not last and _value(other) is not None and _value(other).dim() == 1:  # (hidden,)
                        params[name], last = other, user
                        chain.insert(0, user)
            out = _to_dtype(last, dtype, output=True)
            if out is None or out is n:
                continue
            return params.get("weight"), params.get("bias"), plus.args[1], out, \
                ([out] if out is not last else []) + chain
    return None


def layer_norm(z, dtype, hidden):
    """(weight or None, bias or None, eps, node replaced, nodes erased) of
    aten.native_layer_norm(z, [hidden], weight, bias, eps)[0], z possibly cast
    to fp32 first and the result cast back to dtype (OLMo's F.layer_norm in
    fp32), as AOT writes F.layer_norm, or of model code's LayerNorm in aten
    ops (_centred, then _weighted: Cohere's); or None. The weight's and bias's dtype
    and shape are the caller's to check."""
    starts = [(z, [])] + [(up, [up]) for up in z.users if _cast_to(up, z, torch.float32) and len(up.users) == 1]
    for source, erased in starts:
        for norm in source.users:
            if not _call(norm, (_A.native_layer_norm.default,)) or norm.kwargs or len(norm.args) != 5 \
                    or norm.args[0] is not source or list(norm.args[1]) != [hidden] \
                    or not isinstance(norm.args[4], float):
                continue
            out = _only_user(norm)
            if not (_call(out, (operator.getitem,)) and out.args == (norm, 0)):
                continue
            if source is not z:
                down = _only_user(out)
                if not _cast_to(down, out, dtype):
                    continue
                erased, out = [down, out, norm] + erased, down
            else:
                erased = [out, norm]
            return norm.args[2], norm.args[3], norm.args[4], out, erased
    found = _decomposed(z, dtype)
    if found is not None:
        return found
    for n, eps, chain in _centred(z, dtype):  # model code's LayerNorm, decomposed (Cohere)
        found = _weighted(n, dtype)
        if found is not None:
            weight, out, erased = found
            return weight, None, eps, out, erased + chain
    return None
