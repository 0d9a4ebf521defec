"""Fake (meta) implementations of the ops, so torch.compile and FakeTensorMode
can trace them without running a collective."""
import torch

# handle -> world size. The all-gather output shape needs the communicator's
# world size, which only the handle knows; Communicator registers itself here.
WORLD_SIZES = {}

_registered = False


def register():
    global _registered
    if _registered:
        return
    _registered = True

    @torch.library.register_fake("tpcomm::custom_all_reduce")
    def _all_reduce_fake(input, comm, algo=0):
        return torch.empty_like(input, memory_format=torch.contiguous_format)

    @torch.library.register_fake("tpcomm::custom_all_reduce_out")
    def _all_reduce_out_fake(input, out, comm, algo=0):
        return None

    @torch.library.register_fake("tpcomm::custom_all_gather")
    def _all_gather_fake(input, dim, comm, algo=0):
        if input.dim() == 0:
            raise ValueError("tpcomm: all_gather needs a tensor with at least one dimension")
        d = dim + input.dim() if dim < 0 else dim
        if not 0 <= d < input.dim():
            raise IndexError(f"tpcomm: dim {dim} is out of range for {input.dim()} dimensions")
        if comm not in WORLD_SIZES:
            raise ValueError(f"tpcomm: handle {comm} is not an open communicator")
        shape = list(input.shape)
        shape[d] *= WORLD_SIZES[comm]
        return input.new_empty(shape)
