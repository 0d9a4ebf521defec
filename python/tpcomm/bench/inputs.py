"""The inputs of a case and what they must give: integer values that sum
exactly in every dtype, the reference from NCCL's all-gather of them, and
the bit-for-bit comparison."""
import zlib

import torch
import torch.distributed as dist


def make_input(rank, op, dtype, numel, device):
    """Integer values in [-4, 4] of torch dtype `dtype`, different on every
    rank: sums are exact."""
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(f"{op}/{dtype}/{numel}".encode()) * 8 + rank)
    return torch.randint(-4, 5, (numel,), generator=g, device=device, dtype=torch.int32).to(dtype)


def reference(op, x0, world):
    """NCCL's all-gather of the inputs (a bit copy); for all_reduce, their sum
    in float64 rounded to the dtype (exact on these integers); for
    reduce_scatter, this rank's part of that sum."""
    gathered = torch.empty((world * x0.numel(),), dtype=x0.dtype, device=x0.device)
    dist.all_gather_into_tensor(gathered, x0)
    if op == "all_gather":
        return gathered
    total = gathered.view(world, -1).double().sum(0).to(x0.dtype)
    if op == "reduce_scatter":
        return total.view(world, -1)[dist.get_rank()].clone()
    return total


def bit_equal(y, ref):
    if not isinstance(y, torch.Tensor) or y.numel() != ref.numel() or y.dtype != ref.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ref.element_size()]
    return torch.equal(y.contiguous().view(-1).view(as_int), ref.contiguous().view(-1).view(as_int))
