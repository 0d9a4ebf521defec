"""Argument checks shared by the Communicator and the ops' fake
implementations, so the same bad input gets the same exception everywhere."""
import operator

import torch


def check_tensor(x, what):
    """TypeError unless x is a torch.Tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tpcomm: {what} must be a torch.Tensor, got {type(x).__name__}")


def check_int_dim(dim, op):
    """TypeError unless dim is an int: checked before anything else about
    the call, so a dim of the wrong type raises alike on every path."""
    if not _is_int(dim):
        raise TypeError(f"tpcomm: {op}: dim must be an int, got {type(dim).__name__} {dim!r}")


def checked_dim(x, dim, op):
    """`dim` of x made non-negative; ValueError for a 0-dim x, IndexError for
    a dim out of range, TypeError for a dim that is not an int."""
    check_int_dim(dim, op)
    if x.dim() == 0:
        raise ValueError(f"tpcomm: {op} needs a tensor with at least one dimension")
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"tpcomm: dim {dim} is out of range for {x.dim()} dimensions")
    return dim % x.dim()


def _is_int(dim):
    """An int, a torch.SymInt (what torch.compile traces a dim as) or an
    integer scalar of numpy or torch: what Python indexing accepts; not a bool."""
    if isinstance(dim, bool):
        return False
    try:
        operator.index(dim)
    except TypeError:
        return False
    return True
