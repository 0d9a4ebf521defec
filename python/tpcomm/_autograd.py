"""tpcomm's ops have no backward: their collectives are for inference.

cover() gives each op an Autograd kernel that runs the forward as it is when
inputs require grad (inference without torch.no_grad is common) and gives
its outputs a backward that raises a RuntimeError naming the op. Without it
torch's fallback runs: it warns ("an autograd kernel was not registered to
the Autograd key(s)"), while compiling too, and passes no gradient through
the op, a silently wrong backward. The error is an op of its own,
_tpcomm::no_backward, with a fake that gives the gradient's shape: AOT
autograd traces the backward while it compiles a model whose parameters
require grad, so the error comes when that backward runs, not while
compiling.

A kernel of its own, not torch.library.register_autograd: a call that needs
no gradient (grad mode off or no input requiring one: every call outside
torch.inference_mode, compiled graphs' included, reaches the Autograd key)
costs one check and a redispatch, less host time than register_autograd's
wrapper."""
import torch
from torch import _C

_AFTER_AUTOGRAD = _C._after_autograd_keyset
_grad_enabled, _any_requires_grad = _C.is_grad_enabled, _C._any_requires_grad

NO_BACKWARD = "_tpcomm::no_backward"
_libraries = {"_tpcomm": torch.library.Library("_tpcomm", "FRAGMENT")}  # by namespace, kept alive: they hold the kernels


def _no_backward(grad, size, dtype, op):
    raise RuntimeError(f"tpcomm: {op} has no backward: tpcomm's collectives are for inference. Run the model under "
                       f"torch.no_grad() or torch.inference_mode() (its forward runs either way); to train, use "
                       f"torch.distributed's collectives")


_libraries["_tpcomm"].define("no_backward(Tensor grad, SymInt[] size, ScalarType dtype, str op) -> Tensor")
_libraries["_tpcomm"].impl("no_backward", _no_backward, "CompositeExplicitAutograd")
torch.library.register_fake(NO_BACKWARD, lambda grad, size, dtype, op: grad.new_empty(size, dtype=dtype),
                            lib=_libraries["_tpcomm"])


class _NoBackward(torch.autograd.Function):
    """op's call below autograd; the backward of its outputs (the tensors it
    writes, for an op that returns none) is no_backward for every tensor
    input that needs a gradient."""

    @staticmethod
    def forward(ctx, op, keyset, *args):
        out = op.redispatch(keyset & _AFTER_AUTOGRAD, *args)
        ctx.op = op.name()
        ctx.inputs = [(a.shape, a.dtype) if isinstance(a, torch.Tensor) else None for a in args]
        written = [a for a, arg in zip(args, op._schema.arguments) if arg.alias_info is not None
                   and arg.alias_info.is_write]
        if written:
            ctx.mark_dirty(*written)
            return tuple(written)
        return out

    @staticmethod
    def backward(ctx, *grads):
        grad = grads[0]
        return (None, None) + tuple(
            torch.ops._tpcomm.no_backward(grad, meta[0], meta[1], ctx.op) if meta is not None and needed else None
            for meta, needed in zip(ctx.inputs, ctx.needs_input_grad[2:]))


def _kernel(op):
    returns_none = not op._schema.returns

    def kernel(keyset, *args):
        if _grad_enabled() and _any_requires_grad(*args):
            out = _NoBackward.apply(op, keyset, *args)
            return None if returns_none else out
        return op.redispatch(keyset & _AFTER_AUTOGRAD, *args)

    return kernel


def cover(ops):
    """Registers the Autograd kernel of each of `ops` (OpOverloads with no
    keyword-only arguments) that has none yet, no_backward excepted."""
    for op in ops:
        name = op.name()
        if name == NO_BACKWARD or _C._dispatch_has_kernel_for_dispatch_key(name, "Autograd"):
            continue
        if op.namespace not in _libraries:
            _libraries[op.namespace] = torch.library.Library(op.namespace, "FRAGMENT")
        _libraries[op.namespace].impl(op, _kernel(op), "Autograd", with_keyset=True)
