"""tpcomm's own kernels (csrc/kernels) for one communicator id, through the
internal torch ops torch.ops._tpcomm.* and, for an eager all_reduce, the C
core directly (tpcomm._fastpath): "packet" (barrier-free, small and medium
sizes), "line" (the same scheme in 128-byte lines of data and flag, CUDA
builds only), "two_shot" (all_reduce in lines, in two phases), "bulk" (large
sizes: streamed, or the two-shot all-reduce of more than two ranks), and the
fused all-reduce + add + RMSNorm family (every tpcomm.norm_patterns pattern,
and the FP8 epilogues of tpcomm.norm_fp8). The caller picks the kernel
(tpcomm.routing says which can take a call). They read only their input and the buffers registered at init, so
graph capture needs nothing more. Errors come back as tpcomm's exception
classes."""
import torch

from .. import _dtypes, _lib, routing
from .._fake import NAMESPACE

# Looked up once: every eager all_reduce calls them.
_is_compiling = torch.compiler.is_compiling
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds


def _op(name):
    """The OpOverload of torch.ops._tpcomm.<name>, looked up once per Kernels:
    the eager path calls it directly."""
    return getattr(getattr(torch.ops, NAMESPACE), name).default


class Kernels:
    def __init__(self, comm_id, device_index, caps):
        self.comm_id = comm_id  # the communicator's id, which the ops take
        self.device_index = device_index  # of the communicator's CUDA device: its current stream
        # kernel name -> its tpc_algo code, per op: "bulk" names the one-shot
        # all_reduce at two ranks (routing.VARIANTS)
        self._codes = {op: {kernel: routing.algo_code(op, kernel, caps)
                            for kernel in routing.KERNELS + routing.QUANTIZED} for op in routing.OPS}
        self._all_reduce_out = _op("all_reduce_out")
        self._norm_out = _op("all_reduce_norm_out")
        self._norm_quant_out = _op("all_reduce_norm_quant_out")
        self._all_gather = _op("all_gather")
        self._reduce_scatter = _op("reduce_scatter")
        self._reduce_scatter_f32 = _op("reduce_scatter_f32")
        self._fastpath = _lib.fastpath()
        self._runners = {}  # (dtype, algo) -> all_reduce_runner's callable

    def all_reduce_runner(self, dtype, algo):
        """run(x, out=None): the eager all_reduce on kernel `algo` for this
        dtype, the one both Kernels.all_reduce and Communicator.all_reduce
        (which memoises it per route) call. x is contiguous, of a reducible
        dtype, on the communicator's device; out is None (a new tensor from
        torch.empty_like) or contiguous of x's shape and dtype (x itself
        included). With both 16-byte aligned, the C core runs the op directly
        (tpcomm._fastpath); misaligned tensors, torch.compile tracing, or a
        build without the fast path take the _out torch op, whose binding
        copies misaligned views. Both launch the same kernel."""
        run = self._runners.get((dtype, algo))
        if run is not None:
            return run
        call = self._fastpath.all_reduce if self._fastpath is not None else None
        through_op = self._all_reduce_out
        comm_id, dtype_code, device = self.comm_id, _dtypes.CODE[dtype], self.device_index
        algo_code = self._codes["all_reduce"][algo]

        def run(x, out=None):
            if out is None:
                out = torch.empty_like(x)
            try:
                if call is not None and not _is_compiling():
                    src, dst = x.data_ptr(), out.data_ptr()
                    if not (src | dst) & 15:
                        call(comm_id, src, dst, x.nbytes, dtype_code, algo_code, _raw_stream(device))
                        return out
                through_op(x, out, comm_id, algo_code)
                return out
            except RuntimeError as e:
                raise _lib.translated(e) from None

        self._runners[(dtype, algo)] = run
        return run

    def all_reduce(self, x, algo, out=None):
        """The sum of x over the group on kernel `algo` (see all_reduce_runner)."""
        return self.all_reduce_runner(x.dtype, algo)(x, out)

    def all_reduce_norm(self, pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset, normed,
                        stream_out, bias=None, next_bias=None, residual_scale=1.0):
        """The fused kernel family on fusion pattern `pattern` (tpcomm.norm_patterns):
        writes normed and stream_out (they may be x and residual); every tensor
        contiguous, of x's 16-bit dtype; the vectors (weight, next_weight,
        bias, next_bias) None where the pattern has none (the C core's rules:
        tpc_norm_check); residual_scale m multiplies the term added to the residual."""
        try:
            self._norm_out(x, residual, weight, next_weight, float(eps), float(next_eps), float(weight_offset),
                           int(pattern), normed, stream_out, self.comm_id, bias, next_bias, float(residual_scale))
        except RuntimeError as e:
            raise _lib.translated(e) from None

    def all_reduce_norm_quant(self, pattern, quant, x, residual, weight, next_weight, eps, next_eps, weight_offset,
                              scale_floor, normed, stream_out, codes, scales, bias=None, next_bias=None,
                              residual_scale=1.0):
        """all_reduce_norm with an FP8 epilogue `quant` (tpcomm.fp8.Quant) on
        its normed output: writes codes (e4m3, x's shape, contiguous) and, but
        for PER_TENSOR, whose one-element fp32 scale it reads, scales (fp32,
        any strides: tpcomm.fp8.empty_outputs); normed (x's dtype) only where
        it is not None, and stream_out. scale_floor: the dynamic modes' floor."""
        try:
            self._norm_quant_out(x, residual, weight, next_weight, float(eps), float(next_eps), float(weight_offset),
                                 int(pattern), int(quant), float(scale_floor), normed, stream_out, codes, scales,
                                 self.comm_id, bias, next_bias, float(residual_scale))
        except RuntimeError as e:
            raise _lib.translated(e) from None

    def all_gather(self, x, dim, algo):
        try:
            return self._all_gather(x, dim, self.comm_id, self._codes["all_gather"][algo])
        except RuntimeError as e:
            raise _lib.translated(e) from None

    def reduce_scatter(self, parts, algo):
        """Part `rank` of the sum; parts: dim 0 holds world_size equal parts."""
        try:
            return self._reduce_scatter(parts, self.comm_id, self._codes["reduce_scatter"][algo])
        except RuntimeError as e:
            raise _lib.translated(e) from None

    def reduce_scatter_f32(self, parts, algo):
        """The same part as fp32 sums, not rounded to the dtype."""
        try:
            return self._reduce_scatter_f32(parts, self.comm_id, self._codes["reduce_scatter"][algo])
        except RuntimeError as e:
            raise _lib.translated(e) from None

