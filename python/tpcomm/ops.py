"""The torch ops for model code and torch.compile: tpcomm's one public op
family, taking the group's name.

    y = torch.ops.tpcomm.custom_all_reduce(x, comm.group_name)
    z = torch.ops.tpcomm.custom_all_gather(x, dim, comm.group_name)
    w = torch.ops.tpcomm.custom_reduce_scatter(x, dim, comm.group_name)
    normed, summed = torch.ops.tpcomm.custom_all_reduce_add_rms_norm(x, residual, weight, eps, comm.group_name)
    codes, scales, summed = torch.ops.tpcomm.custom_all_reduce_add_rms_norm_fp8(
        x, residual, weight, eps, "per_token", None, None, False, comm.group_name)

They take the group's name (as vLLM's all_reduce(x, group_name) does), not
a raw handle: a compiled graph holds the dispatcher of that group, which
routes each call (tpcomm's kernels or NCCL) exactly as Communicator.all_reduce
does, and keeps working when the Communicator of the group is replaced.
They are opaque to the compiler (ops with fake implementations), so
fullgraph=True traces through them and mode="reduce-overhead" captures them
in CUDA graphs (the kernels are graph-safe).

The group's open Communicator is looked up in tpcomm._registry on every call:
a group whose Communicator was closed raises CommunicatorClosed, a name that
never had one UnknownGroup (both TpcommErrors). The schemas live here, not in
the C++ binding, so the ops exist where the build is missing (docs/design.md).
The ops taking a communicator id and a kernel (torch.ops._tpcomm.*, defined by
the C++ binding) are internal: the Communicator calls them with the kernel
its routing picked.

Registered with torch.library.Library (define, impl, fake), as vLLM's
direct_register_custom_op does, not with torch.library.custom_op, whose
Python layers (autograd, aliasing checks) add host time to every eager call
(benchmarks/host_cost.py measures both). The ops have no backward: each
gets tpcomm._autograd's Autograd kernel, which runs the op's function
itself where no gradient is needed (on plain CPU/CUDA tensors; it
redispatches for fake tensors and the like), and a backward through one
raises. The internal ops have none: torch's C++ fallback passes them
through.
"""
import torch

from . import _autograd, fp8, norm_fp8, norm_patterns
from ._registry import communicator_for
from ._shapes import checked_dim

_LIBRARY = torch.library.Library("tpcomm", "FRAGMENT")  # kept alive: it holds the registrations
# The internal namespace (the C++ binding defines its ops taking a communicator id): the private op
# the compile pass puts in graphs lives there, so torch.ops.tpcomm holds only the public family.
_INTERNAL = torch.library.Library("_tpcomm", "FRAGMENT")
NAMESPACES = (_LIBRARY.ns, _INTERNAL.ns)  # every op tpcomm registers lives in one of these


def _op(schema, fake, library=_LIBRARY):
    """Defines <namespace>::<schema> with the decorated function as its kernel on
    every device (CompositeExplicitAutograd), `fake` as its shape function
    for torch.compile and an Autograd kernel that refuses a backward and
    calls the function itself where it can (tpcomm._autograd)."""
    name = schema.split("(", 1)[0]

    def define(impl):
        library.define(schema)
        library.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{library.ns}::{name}", fake, lib=library)
        _autograd.cover(getattr(getattr(torch.ops, library.ns), name).default, impl)
        return impl

    return define


def _all_reduce_fake(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_op("custom_all_reduce(Tensor x, str group_name) -> Tensor", _all_reduce_fake)
def custom_all_reduce(x, group_name):
    """Sum of x over the group named group_name (a new tensor)."""
    y = communicator_for(group_name).all_reduce(x)
    return y if y.data_ptr() != x.data_ptr() else y.clone()  # an op's output never aliases its input


def _all_gather_fake(x, dim, group_name):
    shape = list(x.shape)
    shape[checked_dim(x, dim, "all_gather")] *= communicator_for(group_name).world_size
    return x.new_empty(shape)


@_op("custom_all_gather(Tensor x, SymInt dim, str group_name) -> Tensor", _all_gather_fake)
def custom_all_gather(x, dim, group_name):
    """Concatenation of every rank's x along dim, contiguous."""
    return communicator_for(group_name).all_gather(x, dim)


def _reduce_scatter_fake(x, dim, group_name):
    shape = list(x.shape)
    shape[checked_dim(x, dim, "reduce_scatter")] //= communicator_for(group_name).world_size
    return x.new_empty(shape)


@_op("custom_reduce_scatter(Tensor x, SymInt dim, str group_name) -> Tensor", _reduce_scatter_fake)
def custom_reduce_scatter(x, dim, group_name):
    """This rank's part (along dim) of the sum over the group, contiguous."""
    y = communicator_for(group_name).reduce_scatter(x, dim)
    return y if y.data_ptr() != x.data_ptr() else y.clone()


def _all_reduce_add_rms_norm_fake(x, residual, weight, eps, group_name):
    return torch.empty_like(x), torch.empty_like(residual)


@_op("custom_all_reduce_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, str group_name) "
     "-> (Tensor, Tensor)", _all_reduce_add_rms_norm_fake)
def custom_all_reduce_add_rms_norm(x, residual, weight, eps, group_name):
    """(rms_norm(z) * weight, z) with z = all_reduce(x) + residual over the
    group named group_name (new tensors)."""
    return communicator_for(group_name).all_reduce_add_rms_norm(x, residual, weight, eps)


def _all_reduce_norm_fake(x, residual, weight, next_weight, eps, next_eps, weight_offset, pattern, group_name,
                          bias=None, next_bias=None, residual_scale=1.0):
    return torch.empty_like(x), torch.empty_like(residual)


@_op("all_reduce_norm(Tensor x, Tensor residual, Tensor? weight, Tensor? next_weight, float eps, float next_eps, "
     "float weight_offset, int pattern, str group_name, Tensor? bias=None, Tensor? next_bias=None, "
     "float residual_scale=1.0) -> (Tensor, Tensor)", _all_reduce_norm_fake, _INTERNAL)
def _all_reduce_norm(x, residual, weight, next_weight, eps, next_eps, weight_offset, pattern, group_name, bias=None,
                     next_bias=None, residual_scale=1.0):
    """Private: the fusion pattern `pattern` (tpcomm.norm_patterns.Pattern)
    of the all-reduce of x with the residual add (its term scaled by
    residual_scale) and the RMSNorm(s) or LayerNorm(s) around it, (normed,
    stream) as new tensors. tpcomm.fusion puts it in a graph; model code
    calls the public all_reduce_add_rms_norm."""
    return norm_patterns.run(communicator_for(group_name), pattern, x, residual, weight, next_weight, eps,
                             next_eps, weight_offset, bias, next_bias, residual_scale)


def _private_floor(quant, scale_floor):
    """The private op's scale_floor as tpcomm.norm_fp8 takes it: PER_TENSOR uses none."""
    return None if fp8.parse_quant(quant) == fp8.Quant.PER_TENSOR else scale_floor


def _fp8_fake(x, residual, quant, scale, scale_floor, column_major_scales):
    """(codes, scales, stream) as tpcomm.norm_fp8.run makes them (its arguments checked as it checks them)."""
    quant, _ = fp8.check_args(quant, x, scale, scale_floor, column_major_scales)
    codes, scales = fp8.empty_outputs(x, quant, scale, column_major_scales)
    return codes, scales, residual.new_empty(residual.shape)


def _all_reduce_norm_fp8_fake(x, residual, weight, next_weight, eps, next_eps, weight_offset, pattern, quant, scale,
                              scale_floor, column_major_scales, return_normed, group_name, bias=None, next_bias=None,
                              residual_scale=1.0):
    codes, scales, stream = _fp8_fake(x, residual, quant, scale, _private_floor(quant, scale_floor),
                                      column_major_scales)
    return codes, scales, stream, x.new_empty(x.shape if return_normed else (0,))


@_op("all_reduce_norm_fp8(Tensor x, Tensor residual, Tensor? weight, Tensor? next_weight, float eps, float next_eps, "
     "float weight_offset, int pattern, int quant, Tensor? scale, float scale_floor, bool column_major_scales, "
     "bool return_normed, str group_name, Tensor? bias=None, Tensor? next_bias=None, float residual_scale=1.0) "
     "-> (Tensor codes, Tensor scales, Tensor stream, Tensor normed)", _all_reduce_norm_fp8_fake, _INTERNAL)
def _all_reduce_norm_fp8(x, residual, weight, next_weight, eps, next_eps, weight_offset, pattern, quant, scale,
                         scale_floor, column_major_scales, return_normed, group_name, bias=None, next_bias=None,
                         residual_scale=1.0):
    """Private: all_reduce_norm with the FP8 epilogue `quant`
    (tpcomm.fp8.Quant; scale_floor unused by PER_TENSOR) on its normed
    output: (codes, scales, stream, normed), normed empty (numel 0) unless
    return_normed (tpcomm.norm_fp8)."""
    out = norm_fp8.run(communicator_for(group_name), pattern, quant, x, residual, weight, next_weight, eps, next_eps,
                       weight_offset, scale, _private_floor(quant, scale_floor), column_major_scales, return_normed,
                       bias, next_bias, residual_scale)
    return out.codes, out.scales, out.summed, out.normed if return_normed else x.new_empty(0)


def _all_reduce_add_rms_norm_fp8_fake(x, residual, weight, eps, quant, scale, scale_floor, column_major_scales,
                                      group_name):
    return _fp8_fake(x, residual, quant, scale, scale_floor, column_major_scales)


@_op("custom_all_reduce_add_rms_norm_fp8(Tensor x, Tensor residual, Tensor weight, float eps, str quant, "
     "Tensor? scale, float? scale_floor, bool column_major_scales, str group_name) "
     "-> (Tensor codes, Tensor scales, Tensor summed)", _all_reduce_add_rms_norm_fp8_fake)
def custom_all_reduce_add_rms_norm_fp8(x, residual, weight, eps, quant, scale, scale_floor, column_major_scales,
                                       group_name):
    """custom_all_reduce_add_rms_norm with its normed output quantized to
    FP8 e4m3: (codes, scales, summed); quant "per_tensor" (with scale),
    "per_token" or "per_token_group" (tpcomm.fp8)."""
    out = communicator_for(group_name).all_reduce_add_rms_norm_fp8(
        x, residual, weight, eps, quant, scale=scale, scale_floor=scale_floor,
        column_major_scales=column_major_scales)
    return out.codes, out.scales, out.summed


def registered():
    """Every op registered now in NAMESPACES, as OpOverloads (the C++
    binding's _tpcomm ops among them once tpcomm.load() has run): the
    schemas in torch.compile's cache key (tpcomm._cache_key)."""
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace in NAMESPACES:
            name, _, overload = name.partition(".")
            found.append(getattr(getattr(getattr(torch.ops, namespace), name), overload or "default"))
    return found

