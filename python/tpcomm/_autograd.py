"""tpcomm's torch ops have no backward: their collectives are for inference.

cover() gives each op that tpcomm.ops defines in Python an Autograd kernel
that runs the forward as it is when inputs require grad (inference without
torch.no_grad is common) and gives its outputs a backward that raises a
RuntimeError naming the op. Without it torch's fallback runs: it warns ("an
autograd kernel was not registered to the Autograd key(s)"), while compiling
too, and passes no gradient through the op, a silently wrong backward. The
error is an op of its own, _tpcomm::no_backward, with a fake that gives the
gradient's shape: AOT autograd traces the backward while it compiles a model
whose parameters require grad, so the error comes when that backward runs,
not while compiling.

Host time: every call outside torch.inference_mode reaches the Autograd key,
torch.no_grad's and compiled graphs' included. A call that needs no gradient
runs the op's Python implementation from the Autograd kernel itself where
the keys below autograd are those of plain dense CPU or CUDA tensors, whose
kernel is that implementation (CompositeExplicitAutograd): one Python kernel
per call, as under torch's C++ fallback, not two and a redispatch; what is
left is the key set handed to Python and one lookup. Any other key below
autograd (Python: fake tensors and dispatch modes; Functionalize; Meta,
where the fake runs; a conjugate view) has a kernel of its own, so the call
redispatches. The decision is memoised per dispatch key set.

The C++ binding's internal ops (taking a communicator id) get no such kernel:
the Communicator calls them on its eager hot path, where a Python kernel in
front of each would cost a Python call and a redispatch; under the ops
covered here they run with grad mode off (inside the backward-refusing
autograd.Function) or with no input that requires grad, so torch's C++
fallback in front of them passes them through. The Communicator's methods,
which call them directly, give their outputs the same refusing backward
where an input requires grad (without_backward)."""
import functools

import torch
from torch import _C

_AFTER_AUTOGRAD = _C._after_autograd_keyset
_grad_enabled, _any_requires_grad = _C.is_grad_enabled, _C._any_requires_grad
_DENSE = (_C.DispatchKey.CPU, _C.DispatchKey.CUDA)

NO_BACKWARD = "_tpcomm::no_backward"
_LIBRARY = torch.library.Library("_tpcomm", "FRAGMENT")  # kept alive: it holds no_backward
_libraries = {}  # by namespace, kept alive: they hold the Autograd kernels
_dense = {}  # DispatchKeySet.raw_repr() -> whether the keys below autograd are those of dense CPU/CUDA tensors


def _no_backward(grad, size, dtype, op):
    raise RuntimeError(f"tpcomm: {op} has no backward: tpcomm's collectives are for inference. Run the model under "
                       f"torch.no_grad() or torch.inference_mode() (its forward runs either way); to train, use "
                       f"torch.distributed's collectives")


_LIBRARY.define("no_backward(Tensor grad, SymInt[] size, ScalarType dtype, str op) -> Tensor")
_LIBRARY.impl("no_backward", _no_backward, "CompositeExplicitAutograd")
torch.library.register_fake(NO_BACKWARD, lambda grad, size, dtype, op: grad.new_empty(size, dtype=dtype), lib=_LIBRARY)


def dense(keyset):
    """Whether the highest key of `keyset` below autograd is CPU or CUDA:
    then no key with a kernel of its own (Python, Functionalize, Meta,
    Conjugate, ...) is in it, since each outranks the dense backends, and
    fallthrough keys are already out of a keyset the dispatcher hands a
    kernel. Memoised in _dense by the keyset's bits (the kernel reads
    _dense itself)."""
    is_dense = _dense[keyset.raw_repr()] = (keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() in _DENSE
    return is_dense


class _NoBackward(torch.autograd.Function):
    """call(*args) with grad mode off; the backward of its outputs is
    no_backward for every tensor input that needs a gradient."""

    @staticmethod
    def forward(ctx, call, op_name, *args):
        ctx.op = op_name
        ctx.inputs = [(a.shape, a.dtype) if isinstance(a, torch.Tensor) else None for a in args]
        return call(*args)

    @staticmethod
    def backward(ctx, *grads):
        grad = grads[0]
        return (None, None) + tuple(
            torch.ops._tpcomm.no_backward(grad, meta[0], meta[1], ctx.op) if meta is not None and needed else None
            for meta, needed in zip(ctx.inputs, ctx.needs_input_grad[2:]))


def needs_grad(*tensors):
    """Whether a call on `tensors` must give its outputs a backward."""
    return _grad_enabled() and _any_requires_grad(*tensors)


def without_backward(call, op_name, *args):
    """call(*args), whose outputs (new tensors) get a backward that raises
    naming op_name: what tpcomm.Communicator's methods return when an input
    requires grad (their kernels and the fallback pass no gradient)."""
    return _NoBackward.apply(call, op_name, *args)


def _in_place_unrecorded(*tensors):
    """Whether writing into `tensors` must not be recorded: a leaf that
    requires grad cannot take an in-place op that autograd records."""
    return any(t.is_leaf and t.requires_grad for t in tensors)


def all_reduce_without_backward(run, x, out):
    """Communicator.all_reduce's run(x, out) where x requires grad: a new sum
    refuses its backward, and so does `out` written from it; into a leaf
    that requires grad (dist.all_reduce(param), in place, under install())
    the sum is written unrecorded, as torch.distributed's in-place
    collectives write."""
    if out is not None and _in_place_unrecorded(out):
        with torch.no_grad():
            return run(x, out)
    y = without_backward(run, "all_reduce", x, None)
    return y if out is None else out.copy_(y)


def add_rms_norm_without_backward(run, comm, how, x, residual, weight, eps, in_place):
    """tpcomm.add_rms_norm.run for Communicator.all_reduce_add_rms_norm where
    an input requires grad, as all_reduce_without_backward does it."""
    if in_place and _in_place_unrecorded(x, residual):
        with torch.no_grad():
            return run(comm, how, x, residual, weight, eps, True)
    normed, summed = without_backward(run, "all_reduce_add_rms_norm", comm, how, x, residual, weight, eps, False)
    return (x.copy_(normed), residual.copy_(summed)) if in_place else (normed, summed)


def cover(op, impl):
    """Registers op's Autograd kernel; `op` (an OpOverload with no
    keyword-only arguments, returning tensors and writing none of its
    inputs) has `impl` as its CompositeExplicitAutograd kernel."""
    schema = op._schema
    if not schema.returns or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        raise ValueError(f"tpcomm: {op.name()}: the Autograd kernel takes functional ops only")
    name = op.name()

    def kernel(keyset, *args):
        if _grad_enabled() and _any_requires_grad(*args):
            return _NoBackward.apply(functools.partial(kernel, keyset), name, *args)
        is_dense = _dense.get(keyset.raw_repr())
        if is_dense is None:
            is_dense = dense(keyset)
        if is_dense:
            return impl(*args)
        return op.redispatch(keyset & _AFTER_AUTOGRAD, *args)

    if op.namespace not in _libraries:
        _libraries[op.namespace] = torch.library.Library(op.namespace, "FRAGMENT")
    _libraries[op.namespace].impl(op, kernel, "Autograd", with_keyset=True)
