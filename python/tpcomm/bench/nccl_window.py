"""NCCL's symmetric kernels: NCCL on tensors that lie in a window registered
with every peer. torch 2.11 exposes windows through ProcessGroupNCCL
(register_mem_pool(pool, symm=True), whose C++ side calls
ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC). One buffer is allocated
from a torch.cuda.MemPool on the backend's mem_allocator (ncclMemAlloc), then
the pool is registered; the ops run on views of it at the same offsets on
every rank: the input region at 0, the output region after it. A caller's
data must be copied in (or allocated there); graph capture needs nothing
beyond the registration.

Set-up is two steps, so that a caller can exchange verdicts between them
(every rank must register, or none): allocate() is local, register() is
collective."""
import torch
import torch.distributed as dist

from ..backends import Unavailable


def _round_up(n, k):
    return (int(n) + k - 1) // k * k


class NcclWindow:
    name = "nccl_window"

    def __init__(self, group, device, in_bytes, out_bytes):
        self.group, self.device = group, device
        self.in_bytes = _round_up(in_bytes, 1 << 16)
        self.out_bytes = _round_up(out_bytes, 1 << 16)
        self.backend = self.pool = self.buf = None
        self.registered = False

    def allocate(self):
        """Local: the pool and its buffer. Raises Unavailable or the error."""
        backend = self.group._get_backend(self.device)
        if not hasattr(backend, "register_mem_pool"):
            raise Unavailable(f"{type(backend).__name__} has no register_mem_pool (not ProcessGroupNCCL)")
        if backend.mem_allocator is None:
            raise Unavailable("ProcessGroupNCCL.mem_allocator is None (no ncclMemAlloc)")
        self.backend = backend
        self.pool = torch.cuda.MemPool(backend.mem_allocator)
        with torch.cuda.use_mem_pool(self.pool):
            self.buf = torch.empty(self.in_bytes + self.out_bytes, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)

    def register(self):
        """Collective: ncclCommWindowRegister on every rank."""
        try:
            self.backend.register_mem_pool(self.pool, symm=True)
        except TypeError as e:
            raise Unavailable(f"this torch's register_mem_pool takes no symm argument: {e}") from None
        torch.cuda.synchronize(self.device)
        self.registered = True

    def describe(self):
        return (f"{(self.in_bytes + self.out_bytes) >> 20} MiB from torch.cuda.MemPool(ProcessGroupNCCL."
                f"mem_allocator), ProcessGroupNCCL.register_mem_pool(pool, symm=True)")

    def view(self, region, dtype, numel):
        """A view of `numel` elements at the start of the "in" or "out" region."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        off, limit = (0, self.in_bytes) if region == "in" else (self.in_bytes, self.out_bytes)
        if nbytes > limit:
            raise Unavailable(f"{nbytes} bytes are over the window's {limit}-byte {region} region")
        return self.buf[off:off + nbytes].view(dtype)

    # The ops, on views of the window (x from view("in", ...)).
    def all_reduce(self, x):
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x, out=None):
        """Into `out` (a view of the "out" region; made here when None)."""
        if out is None:
            out = self.view("out", x.dtype, x.numel() * dist.get_world_size(self.group))
        dist.all_gather_into_tensor(out, x, group=self.group)
        return out

    def reduce_scatter(self, x, out=None):
        if out is None:
            out = self.view("out", x.dtype, x.numel() // dist.get_world_size(self.group))
        dist.reduce_scatter_tensor(out, x, group=self.group)
        return out

    def close(self):
        """Collective (a barrier first: no peer may still use the window)."""
        if self.registered:
            dist.barrier(group=self.group)
            self.backend.deregister_mem_pool(self.pool)
            self.registered = False
        self.buf = self.pool = None
