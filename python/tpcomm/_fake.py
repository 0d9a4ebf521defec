"""Fake (meta) implementations of the ops, so torch.compile and FakeTensorMode
can trace them without running a collective."""
import torch

from ._shapes import checked_dim

# handle -> world size. The all-gather output shape needs the communicator's
# world size, which only the handle knows; Communicator registers itself here.
WORLD_SIZES = {}

_registered = False


def register():
    global _registered
    if _registered:
        return
    _registered = True

    @torch.library.register_fake("_tpcomm::all_reduce")
    def _all_reduce_fake(input, comm, algo):
        return torch.empty_like(input, memory_format=torch.contiguous_format)

    @torch.library.register_fake("_tpcomm::all_reduce_out")
    def _all_reduce_out_fake(input, out, comm, algo):
        return None

    @torch.library.register_fake("_tpcomm::all_reduce_add_rms_norm_out")
    def _all_reduce_add_rms_norm_out_fake(input, residual, weight, eps, normed, residual_out, comm):
        return None

    @torch.library.register_fake("_tpcomm::reduce_scatter")
    def _reduce_scatter_fake(input, comm, algo):
        return input.new_empty(_scattered_shape(input, comm))

    @torch.library.register_fake("_tpcomm::reduce_scatter_f32")
    def _reduce_scatter_f32_fake(input, comm, algo):
        return input.new_empty(_scattered_shape(input, comm), dtype=torch.float32)

    @torch.library.register_fake("_tpcomm::all_gather")
    def _all_gather_fake(input, dim, comm, algo):
        shape = list(input.shape)
        shape[checked_dim(input, dim, "all_gather")] *= _world_size(comm)
        return input.new_empty(shape)


def _scattered_shape(input, comm):
    world = _world_size(comm)
    if input.dim() == 0 or input.shape[0] % world:
        raise ValueError(f"tpcomm: reduce_scatter needs dim 0 divisible by the world size {world}")
    return (input.shape[0] // world,) + tuple(input.shape[1:])


def _world_size(comm):
    if comm not in WORLD_SIZES:
        raise ValueError(f"tpcomm: handle {comm} is not an open communicator")
    return WORLD_SIZES[comm]
