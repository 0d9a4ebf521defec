"""Shape checks shared by the Communicator and the ops' fake implementations,
so the same bad input gets the same exception everywhere."""


def checked_dim(x, dim, op):
    """`dim` of x made non-negative; ValueError for a 0-dim x, IndexError for
    a dim out of range."""
    if x.dim() == 0:
        raise ValueError(f"tpcomm: {op} needs a tensor with at least one dimension")
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"tpcomm: dim {dim} is out of range for {x.dim()} dimensions")
    return dim % x.dim()
