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
        op = _OVERLOADS[name] = getattr(torch.ops._tpcomm, name).default
    return op


_REDUCE_DTYPE_CODES = {getattr(torch, name): code for name, code in _lib.DTYPE_CODES.items()}  # tpc_dtype


class Kernels:
    def __init__(self, handle, device_index):
        self.handle = handle  # the communicator id the ops take
        self.device_index = device_index  # of the communicator's CUDA device: its current stream
        self._all_reduce_out = custom("all_reduce_out")
        self._fastpath = _lib.fastpath()

    def fast_all_reduce(self, dtype, algo):
        """(call, id, dtype code, algorithm code) of the fast path's all_reduce
        for this dtype and kernel, or None where the module is not built: what
        Communicator.all_reduce calls inline, with the tensors' pointers, the
        size and the current raw stream, as all_reduce below does."""
        if self._fastpath is None:
            return None
        return (self._fastpath.all_reduce, self.handle, _REDUCE_DTYPE_CODES[dtype], ALGOS[algo])

    def all_reduce(self, x, algo, out=None):
        """x is contiguous, of a reducible dtype, on the communicator's device.
        A new output comes from torch.empty_like. Eagerly, with both tensors
        16-byte aligned, the C core runs the op directly (tpcomm._fastpath);
        otherwise, and while torch.compile traces, the _out torch op does,
        which copies misaligned views. Both launch the same kernel. On the
        2xH200 host the torch op costs about 2 us more per call, and
        allocating in Python less than the op that allocates through the
        stable ABI (benchmarks/host_cost.py)."""
        try:
            if out is None:
                out = torch.empty_like(x)
            fast = self._fastpath
            if fast is not None and not torch.compiler.is_compiling():
                src, dst = x.data_ptr(), out.data_ptr()
                if not (src | dst) & 15:
                    fast.all_reduce(self.handle, src, dst, x.nbytes,
                                    _REDUCE_DTYPE_CODES[x.dtype], ALGOS[algo],
                                    torch._C._cuda_getCurrentRawStream(self.device_index))
                    return out
            self._all_reduce_out(x, out, self.handle, ALGOS[algo])
            return out
        except RuntimeError as e:
            raise _lib.translated(e) from None

    def all_reduce_add_rms_norm(self, x, residual, weight, eps, normed, residual_out):
        """The fused kernel: writes normed and residual_out (they may be x and
        residual); every tensor contiguous, of x's 16-bit dtype."""
        try:
            custom("all_reduce_add_rms_norm_out")(x, residual, weight, float(eps), normed, residual_out,
                                                         self.handle)
        except RuntimeError as e:
            raise _lib.translated(e) from None

    def all_gather(self, x, dim, algo):
        try:
            return custom("all_gather")(x, dim, self.handle, ALGOS[algo])
        except RuntimeError as e:
            raise _lib.translated(e) from None

    def reduce_scatter(self, parts, algo):
        """Part `rank` of the sum; parts: dim 0 holds world_size equal parts."""
        try:
            return custom("reduce_scatter")(parts, self.handle, ALGOS[algo])
        except RuntimeError as e:
            raise _lib.translated(e) from None

    def reduce_scatter_f32(self, parts, algo):
        """The same part as fp32 sums, not rounded to the dtype."""
        try:
            return custom("reduce_scatter_f32")(parts, self.handle, ALGOS[algo])
        except RuntimeError as e:
            raise _lib.translated(e) from None
