"""Dispatcher-level torch ops for model code and torch.compile.

    y = torch.ops.tpcomm.all_reduce(x, comm.group_name)
    z = torch.ops.tpcomm.all_gather(x, dim, comm.group_name)
    w = torch.ops.tpcomm.reduce_scatter(x, dim, comm.group_name)
    normed, summed = torch.ops.tpcomm.all_reduce_add_rms_norm(x, residual, weight, eps, comm.group_name)

They take the group's name (as vLLM's all_reduce(x, group_name) does), not
a raw handle: a compiled graph holds the dispatcher of that group, which
routes each call (tpcomm's kernels or NCCL) exactly as Communicator.all_reduce
does, and keeps working when the Communicator of the group is replaced.
They are opaque to the compiler (torch.library custom ops with fake
implementations), so fullgraph=True traces through them and mode=
"reduce-overhead" captures them in CUDA graphs (the kernels are graph-safe).
"""
import torch

from ._shapes import checked_dim

_COMMUNICATORS = {}  # group name -> the open Communicator of that group created last


def register(comm):
    _COMMUNICATORS[comm.group_name] = comm


def unregister(comm):
    if _COMMUNICATORS.get(comm.group_name) is comm:
        del _COMMUNICATORS[comm.group_name]


def communicator_for(group_name):
    comm = _COMMUNICATORS.get(group_name)
    if comm is None:
        raise RuntimeError(f"tpcomm: no open Communicator for group {group_name!r} in this process "
                           f"(open: {sorted(_COMMUNICATORS)})")
    return comm


@torch.library.custom_op("tpcomm::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of x over the group named group_name (a new tensor)."""
    y = communicator_for(group_name).all_reduce(x)
    return y if y.data_ptr() != x.data_ptr() else y.clone()  # a custom op's output never aliases its input


@all_reduce.register_fake
def _all_reduce_fake(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tpcomm::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Concatenation of every rank's x along dim, contiguous."""
    return communicator_for(group_name).all_gather(x, dim)


@all_gather.register_fake
def _all_gather_fake(x, dim, group_name):
    shape = list(x.shape)
    shape[checked_dim(x, dim, "all_gather")] *= communicator_for(group_name).world_size
    return x.new_empty(shape)


@torch.library.custom_op("tpcomm::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """This rank's part (along dim) of the sum over the group, contiguous."""
    y = communicator_for(group_name).reduce_scatter(x, dim)
    return y if y.data_ptr() != x.data_ptr() else y.clone()


@reduce_scatter.register_fake
def _reduce_scatter_fake(x, dim, group_name):
    shape = list(x.shape)
    shape[checked_dim(x, dim, "reduce_scatter")] //= communicator_for(group_name).world_size
    return x.new_empty(shape)


@torch.library.custom_op("tpcomm::all_reduce_add_rms_norm", mutates_args=())
def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(z) * weight, z) with z = all_reduce(x) + residual over the
    group named group_name (new tensors)."""
    return communicator_for(group_name).all_reduce_add_rms_norm(x, residual, weight, eps)


@all_reduce_add_rms_norm.register_fake
def _all_reduce_add_rms_norm_fake(x, residual, weight, eps, group_name):
    return torch.empty_like(x), torch.empty_like(residual)
