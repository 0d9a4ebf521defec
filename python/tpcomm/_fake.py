"""Fake (meta) implementations of the internal ops torch.ops._tpcomm.* (the
C++ binding defines them and their CUDA kernels), so torch.compile and
FakeTensorMode can trace them without running a collective. The output shape
of a gather or scatter needs the world size, which the comm_id's entry
in tpcomm._registry holds."""
import torch

from . import _registry
from ._shapes import checked_dim

NAMESPACE = "_tpcomm"
_registered = False


def register():
    global _registered
    if _registered:
        return
    _registered = True

    @torch.library.register_fake(f"{NAMESPACE}::all_reduce")
    def _all_reduce_fake(input, comm_id, algo):
        return torch.empty_like(input, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{NAMESPACE}::all_reduce_out")
    def _all_reduce_out_fake(input, out, comm_id, algo):
        return None

    @torch.library.register_fake(f"{NAMESPACE}::all_reduce_norm_out")
    def _all_reduce_norm_out_fake(input, residual, weight, next_weight, eps, next_eps, weight_offset, pattern, normed,
                                  stream_out, comm_id, bias=None, next_bias=None, residual_scale=1.0):
        return None

    @torch.library.register_fake(f"{NAMESPACE}::all_reduce_norm_quant_out")
    def _all_reduce_norm_quant_out_fake(input, residual, weight, next_weight, eps, next_eps, weight_offset, pattern,
                                        quant, scale_floor, normed, stream_out, codes, scales, comm_id, bias=None,
                                        next_bias=None, residual_scale=1.0):
        return None

    @torch.library.register_fake(f"{NAMESPACE}::reduce_scatter")
    def _reduce_scatter_fake(input, comm_id, algo):
        return input.new_empty(_scattered_shape(input, comm_id))

    @torch.library.register_fake(f"{NAMESPACE}::reduce_scatter_f32")
    def _reduce_scatter_f32_fake(input, comm_id, algo):
        return input.new_empty(_scattered_shape(input, comm_id), dtype=torch.float32)

    @torch.library.register_fake(f"{NAMESPACE}::all_gather")
    def _all_gather_fake(input, dim, comm_id, algo):
        shape = list(input.shape)
        shape[checked_dim(input, dim, "all_gather")] *= _registry.by_id(comm_id).world_size
        return input.new_empty(shape)


def _scattered_shape(input, comm_id):
    world = _registry.by_id(comm_id).world_size
    if input.dim() == 0 or input.shape[0] % world:
        raise ValueError(f"tpcomm: reduce_scatter needs dim 0 divisible by the world size {world}")
    return (input.shape[0] // world,) + tuple(input.shape[1:])
