"""The eager half of tpcomm.install for functional collectives: DTensor's
redistribute (the LM head's and colwise_gather_output's all-gathers, the
embedding's all-reduce) and torch.distributed._functional_collectives run
the C++ ops torch.ops._c10d_functional.{all_reduce, all_gather_into_tensor,
reduce_scatter_tensor}, which never reach ProcessGroup's Python methods
(tpcomm.torch_collectives). While a group is installed, those three ops'
CPU and CUDA kernels are replaced (torch.library: the kernel torch
registered is looked up with torch.library.get_kernel and called for
everything tpcomm does not take); a call on an installed group that tpcomm
computes identically (the sum, the group's world size, a plain tensor on
the Communicator's device) runs on the group's Communicator and returns its
result, which _c10d_functional.wait_tensor returns as it is (no work is
registered for it). What these kernels do not see: the in-place forms
(all_reduce_, all_gather_into_tensor_out) and collectives on lists of
tensors, which DTensor does not use for these redistributions.
"""
import torch



_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
_KEYS = ("CPU", "CUDA")
_library = None   # the torch.library.Library holding the replacements, while installed
_originals = {}   # (op, dispatch key) -> torch's kernel


def _plain(comm, x):
    return type(x) is torch.Tensor and x.device == comm.device and x.is_contiguous() and x.dim() > 0


def _run_on_tpcomm(op, args, taker, run):
    """The result of `op` on tpcomm, or None where tpcomm does not take it."""
    if op == "all_reduce":
        if len(args) != 3:
            return None
        x, reduce_op, name = args
        comm = taker(name)
        if comm is None or reduce_op != "sum" or not _plain(comm, x):
            return None
        return run(comm.all_reduce, x)
    if op == "all_gather_into_tensor":
        if len(args) != 3:
            return None
        x, size, name = args
        comm = taker(name)
        if comm is None or size != comm.world_size or not _plain(comm, x):
            return None
        return run(comm.all_gather, x, 0)
    if len(args) != 4:
        return None
    x, reduce_op, size, name = args
    comm = taker(name)
    if comm is None or reduce_op != "sum" or size != comm.world_size or not _plain(comm, x) \
            or x.shape[0] % comm.world_size:
        return None
    return run(comm.reduce_scatter, x, 0)


def _kernel(op, key, taker, run):
    original = _originals[(op, key)]

    def kernel(keyset, *args):
        y = _run_on_tpcomm(op, args, taker, run)
        if y is None:
            return original.call_boxed(keyset, *args)
        return y.clone() if op != "all_gather_into_tensor" and y.data_ptr() == args[0].data_ptr() else y

    return kernel


def hook(taker, run):
    """Replaces the three ops' CPU and CUDA kernels (idempotent): taker(group
    name) gives the Communicator that takes a call on that group or None,
    run(fn, *args) runs tpcomm's call."""
    global _library
    if _library is not None:
        return
    for op in _OPS:
        for key in _KEYS:
            _originals[(op, key)] = torch.library.get_kernel(f"_c10d_functional::{op}", key)
    _library = torch.library.Library("_c10d_functional", "IMPL")
    for op in _OPS:
        for key in _KEYS:
            _library.impl(op, _kernel(op, key, taker, run), key, with_keyset=True)


def unhook():
    """torch's own kernels again."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None
        _originals.clear()


