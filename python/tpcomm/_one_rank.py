"""The ops of a group of one rank, with the dispatcher's signatures: every
one is a copy of its input (the sum, the concatenation and this rank's part
over one rank), made on this device with no collective call. Each returns a
new contiguous tensor, as the ops of a larger group do; all_reduce into
`out` writes there."""
import torch


def all_reduce(x, out=None):
    if out is None:
        return x.clone(memory_format=torch.contiguous_format)
    return out if out.data_ptr() == x.data_ptr() else out.copy_(x)


def all_gather(x, dim):
    return x.clone(memory_format=torch.contiguous_format)


def reduce_scatter(x):
    return x.clone(memory_format=torch.contiguous_format)
