"""A Communicator holding only what routing reads (world size, config,
routes, caps, the fallback's name): its route_* methods answer on the CPU
for any world size, with meta tensors, without a group or a GPU."""
import types

import torch

import tpcomm
from tpcomm import _constants as C
from tpcomm import routing, routing_table
from tpcomm.config import Config

MiB = 1 << 20
# The fallback of a group on GPUs, named as route_* name it; its ops are never run here.
FALLBACK = types.SimpleNamespace(backend="nccl", all_reduce=None, all_gather=None, reduce_scatter=None)


def routing_comm(fused_kernel=True, packet_max_bytes=1 << 20, enabled=True, world_size=2, forbid=()):
    comm = object.__new__(tpcomm.Communicator)
    comm.world_size = world_size
    comm.config = Config(fused_kernel=fused_kernel)
    comm._routes = routing_table.effective_routes(routing_table.load_table(None), world_size, {}, forbid)
    comm._caps = routing.Caps(world_size, 16 * MiB, packet_max_bytes, C.TPC_PLATFORM_CUDA) if enabled else None
    comm._nccl, comm._fallback, comm._closed = FALLBACK, FALLBACK.backend, False
    return comm


def meta(shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")
