"""NCCL (or gloo on the CPU) through torch.distributed: what the dispatcher
falls back to, and the benchmark's reference. Under torch.compile the
functional collectives are traced instead. Nothing to set up; graph capture
needs NCCL's communicator initialised first (an eager call), as always."""
import torch
import torch.distributed as dist

from ..torch_collectives import torch_path


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


def backend_name(group, device=None):
    """The torch.distributed backend that runs `device`'s tensors on group:
    "nccl", "gloo", ... A group made without a backend named has one per
    device type, and get_backend names none of them ("undefined")."""
    name = str(dist.get_backend(group))
    if device is not None and (name == "undefined" or ":" in name):
        try:
            name = group._get_backend(torch.device(device)).name()
        except RuntimeError:  # no backend for that device type: its calls fail in torch, named as torch names it
            pass
    return name


class Nccl:
    name = "nccl"

    def __init__(self, group, device=None):
        self.group = group
        self.backend = backend_name(group, device)  # what really runs the fallback: "nccl", "gloo", ...
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    @torch_path
    def all_reduce(self, x, out=None):
        """Sum over the group into a new tensor, or into `out` (x itself
        included: then in place, with no copy)."""
        if torch.compiler.is_compiling():
            y = _funcol().all_reduce(x, "sum", self.group)
            return y if out is None else out.copy_(y)
        y = x.clone() if out is None else (out.copy_(x) if out.data_ptr() != x.data_ptr() else out)
        dist.all_reduce(y, group=self.group)
        return y

    @torch_path
    def reduce_scatter(self, x):
        """Part `rank` of the sum of x (dim 0 divisible by the world size)."""
        x = x.contiguous()
        if torch.compiler.is_compiling():
            return _funcol().reduce_scatter_tensor(x, "sum", 0, self.group)
        if x.device.type != "cuda":  # gloo has no reduce_scatter_tensor: reduce, then take our part
            y = x.clone()
            dist.all_reduce(y, group=self.group)
            return y.chunk(self.world_size)[self.rank].contiguous()
        out = torch.empty((x.shape[0] // self.world_size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=self.group)
        return out

    @torch_path
    def all_gather(self, x, dim=0):
        """Concatenation of every rank's x along dim, contiguous."""
        x = x.contiguous()
        dim = dim % x.dim()
        if torch.compiler.is_compiling():
            return _funcol().all_gather_tensor(x, dim, self.group)
        if x.device.type != "cuda":  # gloo: list gather
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.group)
            return torch.cat(parts, dim)
        stacked = torch.empty((self.world_size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(stacked, x, group=self.group)
        if dim == 0:
            return stacked
        shape = list(x.shape)
        shape[dim] *= self.world_size
        return stacked.reshape((self.world_size,) + tuple(x.shape)).movedim(0, dim).reshape(shape)
