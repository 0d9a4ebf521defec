"""tpcomm's own kernels (csrc/kernels) through the torch ops, for one
communicator id: "packet" (barrier-free, small and medium sizes), "line"
(the same scheme in 128-byte lines of data and flag, for the sizes the link
sets: all_reduce and all_gather, CUDA builds only) and "bulk" (large sizes:
streamed, or the two-shot all-reduce of more than two ranks),
and the fused all-reduce + add + RMSNorm (packet). They read only their input
and the buffers registered at init, so graph capture needs nothing more (Communicator.capture
only marks the capture). Errors come back as tpcomm's exception classes."""
import torch

from .. import _lib

ALGOS = {"packet": _lib.ALGO_PACKET, "line": _lib.ALGO_LINE, "bulk": _lib.ALGO_BULK}
_OVERLOADS = {}  # op name -> its OpOverload, looked up once: the eager path calls it directly


def custom(name):
    op = _OVERLOADS.get(name)
    if op is None:
        op = _OVERLOADS[name] = getattr(torch.ops.tpcomm, name).default
    return op


class Kernels:
    def __init__(self, handle):
        self.handle = handle  # the communicator id the ops take
        self._all_reduce_out = custom("custom_all_reduce_out")

    def all_reduce(self, x, algo, out=None):
        """x is contiguous. A new output comes from torch.empty_like and the
        _out op: on the 2xH200 host that costs less than the op that
        allocates through the stable ABI's empty_strided (5.3 + 1.6 against
        7.5 us, benchmarks/host_cost.py)."""
        try:
            if out is None:
                out = torch.empty_like(x)
            self._all_reduce_out(x, out, self.handle, ALGOS[algo])
            return out
        except RuntimeError as e:
            raise _lib.translated(e) from None

    def all_reduce_add_rms_norm(self, x, residual, weight, eps, normed, residual_out):
        """The fused kernel: writes normed and residual_out (they may be x and
        residual); every tensor contiguous, of x's 16-bit dtype."""
        try:
            custom("custom_all_reduce_add_rms_norm_out")(x, residual, weight, float(eps), normed, residual_out,
                                                         self.handle)
        except RuntimeError as e:
            raise _lib.translated(e) from None

    def all_gather(self, x, dim, algo):
        try:
            return custom("custom_all_gather")(x, dim, self.handle, ALGOS[algo])
        except RuntimeError as e:
            raise _lib.translated(e) from None

    def reduce_scatter(self, parts, algo):
        """Part `rank` of the sum; parts: dim 0 holds world_size equal parts."""
        try:
            return custom("custom_reduce_scatter")(parts, self.handle, ALGOS[algo])
        except RuntimeError as e:
            raise _lib.translated(e) from None

    def reduce_scatter_f32(self, parts, algo):
        """The same part as fp32 sums, not rounded to the dtype."""
        try:
            return custom("custom_reduce_scatter_f32")(parts, self.handle, ALGOS[algo])
        except RuntimeError as e:
            raise _lib.translated(e) from None
