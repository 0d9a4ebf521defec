"""Which backend runs a call: pure functions of what every rank of a group
shares (op, dtype, byte sizes, the communicator's caps and world size, the
effective routing table), never of where a tensor lies in memory, so the ranks
of a group always pick the same kernel.

This module is the only place with the rules for which of tpcomm's kernels
can take a call (refusal()); route() walks the table's band for the size and,
where the band's kernel cannot take the call, the kernels it falls back to;
add_rms_norm() picks the fused op's route. The C core runs the kernel it is
told and checks only what memory safety needs.

Backends: "packet" (barrier-free, small sizes), "line" (the packet scheme in
128-byte lines, CUDA builds only: it rests on NVLink delivering a warp's
128-byte store whole), "two_shot" (all_reduce in lines, in two phases: each
rank sums one chunk and sends the sums to all; 2(n-1)/n of the input per rank
where "line" sends (n-1) times it), "bulk" (large sizes), "nccl"
(torch.distributed on the same group). Sizes: `nbytes` is the input bytes
per rank; `row` (all_gather) the bytes of one slice along the gathered dim
and everything after it."""
import collections
import math

from . import _constants as C
from . import _dtypes

KERNELS = ("packet", "line", "two_shot", "bulk")
BACKENDS = KERNELS + ("nccl",)
OPS = ("all_reduce", "all_gather", "reduce_scatter")
KERNEL_OPS = {"packet": OPS, "line": OPS, "two_shot": ("all_reduce",), "bulk": OPS}  # the ops each kernel serves
LINE_PROTOCOL = ("line", "two_shot")  # kernels that rest on whole 128-byte stores
PACKET_SLOT_KERNELS = ("packet",) + LINE_PROTOCOL  # kernels whose data lives in the packet slots (packet_max_bytes)
ALGO_CODES = {"packet": C.TPC_ALGO_PACKET, "line": C.TPC_ALGO_LINE, "two_shot": C.TPC_ALGO_TWO_SHOT,
              "bulk": C.TPC_ALGO_BULK}
# The quantized all-reduce (csrc/kernels/all_reduce_quant.cuh), one kernel a
# mode: never a band's backend, only where Config.quantize turned it on
# (quantized()); not exact (docs/design.md bounds its error).
QUANTIZE_MODES = ("fp8", "int8", "int4")
QUANTIZED = tuple(f"quantized_{mode}" for mode in QUANTIZE_MODES)
QUANTIZED_DTYPES = ("float16", "bfloat16")
ALGO_CODES.update({"quantized_fp8": C.TPC_ALGO_QUANTIZED_FP8, "quantized_int8": C.TPC_ALGO_QUANTIZED_INT8,
                   "quantized_int4": C.TPC_ALGO_QUANTIZED_INT4})
# Where a band's kernel cannot take a call, the next of these that can does;
# NCCL when none can.
FALLBACKS = {"packet": ("packet", "bulk"), "line": ("line", "packet", "bulk"),
             "two_shot": ("two_shot", "line", "packet", "bulk"), "bulk": ("bulk", "packet")}


class Caps(collections.namedtuple("Caps", "world_size max_bytes packet_max_bytes line_kernels")):
    """What a communicator with the custom path on can take: its world size,
    max_bytes (the output bytes of one op), packet_max_bytes (the input bytes
    per rank of a packet or line kernel: for reduce_scatter one rank's part),
    and whether the line kernels exist in this build."""


def choose(bands, nbytes):
    """The backend of the first band whose limit is at least nbytes; NCCL past the last."""
    for limit, backend in bands:
        if nbytes <= limit:
            return backend
    return "nccl"


def row_bytes(shape, dim, element_size):
    """The bytes of one slice of an all_gather input along `dim` and every
    dim after it: what the kernel copies as one unit per rank (the whole
    input for a 0-dim tensor)."""
    if not len(shape):
        return element_size
    return math.prod(shape[dim % len(shape):]) * element_size


def _part(op, caps, nbytes):
    """The input bytes per rank of one packet exchange: a reduce_scatter
    sends each peer one part (0 when the parts are not equal)."""
    if op != "reduce_scatter":
        return nbytes
    return nbytes // caps.world_size if nbytes % caps.world_size == 0 else 0


def _no_kernel(op, caps, dtype, nbytes, row):
    """Why no kernel of tpcomm's takes this call, or None."""
    if op == "all_gather":
        if nbytes == 0 or nbytes % 4 or row % 4:
            return "all_gather kernels move 4-byte units: size and row must be positive multiples of 4 bytes"
        return None
    if dtype not in _dtypes.REDUCIBLE:
        return f"{op} kernels reduce {', '.join(_dtypes.NAMES)}, not {dtype}"
    part = _part(op, caps, nbytes)
    if part == 0 or part % 16:
        return f"{op} kernels need {'each part' if op == 'reduce_scatter' else 'the input'} a positive multiple of 16 bytes"
    if nbytes > caps.max_bytes:
        return f"{nbytes} bytes are over max_bytes {caps.max_bytes}"
    return None


def _kernel_refusal(op, kernel, caps, nbytes, row):
    """Why `kernel` cannot take a call some kernel takes, or None."""
    part = _part(op, caps, nbytes)
    sixteen = op != "all_gather" or (nbytes % 16 == 0 and row % 16 == 0)
    if op not in KERNEL_OPS[kernel]:
        return f"{op} has no {kernel} kernel"
    if kernel in LINE_PROTOCOL:
        if not caps.line_kernels:
            return "no line kernels in this build (they rest on NVLink's whole 128-byte stores: CUDA only)"
        if not sixteen:
            return "the line kernel moves 16-byte units: size and row must be multiples of 16 bytes"
    if kernel == "two_shot" and nbytes <= C.TPC_LINE_STEP_BYTES * (caps.world_size - 1):
        return (f"two_shot needs more than {C.TPC_LINE_STEP_BYTES * (caps.world_size - 1)} bytes "
                f"(a warp step of lines, {C.TPC_LINE_STEP_BYTES} bytes, per rank)")
    if kernel in PACKET_SLOT_KERNELS and part > caps.packet_max_bytes:
        return f"{part} bytes per rank are over packet_max_bytes {caps.packet_max_bytes}"
    if kernel == "bulk" and op == "all_gather":
        if not sixteen:
            return "the bulk all_gather moves 16-byte units: size and row must be multiples of 16 bytes"
        if nbytes * caps.world_size > caps.max_bytes:
            return f"an output of {nbytes * caps.world_size} bytes is over max_bytes {caps.max_bytes}"
    return None


def refusal(op, kernel, caps, dtype, nbytes, row=0):
    """Why tpcomm's `kernel` cannot run this call (a sentence), or None when
    it can. caps None: the custom path is off."""
    if op not in OPS or kernel not in KERNELS:
        raise ValueError(f"tpcomm: no {kernel!r} kernel for {op!r} (ops {OPS}, kernels {KERNELS})")
    if caps is None:
        return "the custom path is off"
    return _no_kernel(op, caps, dtype, nbytes, row) or _kernel_refusal(op, kernel, caps, nbytes, row)


def quantized_refusal(caps, dtype, nbytes):
    """Why the quantized all-reduce cannot run an all_reduce, or None."""
    if caps is None:
        return "the custom path is off"
    if _dtypes.NAME.get(dtype) not in QUANTIZED_DTYPES:
        return f"the quantized all_reduce takes {' and '.join(QUANTIZED_DTYPES)}, not {dtype}"
    if not caps.line_kernels:
        return "no quantized kernels in this build (CUDA only)"
    return _no_kernel("all_reduce", caps, dtype, nbytes, 0)


def quantized(routes, caps, dtype, nbytes):
    """The quantized kernel this all_reduce takes ("quantized_<mode>"), or
    None: only where the routes carry a "quantized" row (Config.quantize,
    routing_table.effective_routes), from its minimum size on."""
    row = routes["all_reduce"].get("quantized")
    if not row or nbytes < row[0][0] or quantized_refusal(caps, dtype, nbytes):
        return None
    return row[0][1]


def route(routes, caps, op, dtype, nbytes, row=0):
    """The backend of this call: the table's band for nbytes (routes: what
    routing_table.effective_routes gives), or, where that kernel cannot take it, the
    first of its FALLBACKS that can; NCCL when none can or caps is None.
    An all_reduce the quantized kernel takes (quantized()) goes there."""
    if caps is None or _no_kernel(op, caps, dtype, nbytes, row):
        return "nccl"
    if op == "all_reduce":
        chosen = quantized(routes, caps, dtype, nbytes)
        if chosen:
            return chosen
    by_dtype = routes[op]
    backend = choose(by_dtype.get(_dtypes.NAME.get(dtype), by_dtype["*"]), nbytes)
    for kernel in FALLBACKS.get(backend, ()):
        if _kernel_refusal(op, kernel, caps, nbytes, row) is None:
            return kernel
    return "nccl"


def aiter_first(op, world_size, max_bytes, nbytes, dim=0):
    """Whether AITER's custom all-reduce, where it is open (ROCm), is tried
    before the routed backend: every all_reduce, and an all_gather along dim
    0 (AITER's flat layout) whose output (nbytes input per rank) fits
    max_bytes. AITER itself may still decline the call (its own size and
    alignment rules); what it declines runs on the routed backend."""
    if op == "all_reduce":
        return True
    return op == "all_gather" and dim == 0 and nbytes * world_size <= max_bytes


def add_rms_norm(routes, caps, fused_kernel, dtype, weight_dtype, nbytes, row):
    """How all_reduce_add_rms_norm runs (row: bytes of the last dimension):
    "fused" (one kernel: fp16/bf16, the input within the packet cap, a row of
    at most TPC_NORM_MAX_ROW_BYTES), "split" (reduce-scatter kernels when the
    rows divide among the ranks), else "unfused"."""
    if not (caps is not None and fused_kernel and dtype in _dtypes.NORM_KERNEL and weight_dtype == dtype
            and nbytes > 0 and row > 0 and row % 16 == 0):
        return "unfused"
    if nbytes <= caps.packet_max_bytes and row <= C.TPC_NORM_MAX_ROW_BYTES:
        return "fused"
    if (nbytes // row) % caps.world_size == 0 and route(routes, caps, "reduce_scatter", dtype, nbytes) in KERNELS:
        return "split"
    return "unfused"


def summary(routes, caps):
    """The dispatch order of each op, as logged at init."""
    parts = []
    for op in OPS:
        bands = ", ".join(f"{backend} up to {limit} B" for limit, backend in routes[op]["*"])
        parts.append(f"{op}: {bands}, then nccl (caps: packet {caps.packet_max_bytes} B per rank, "
                     f"output {caps.max_bytes} B)")
    for minimum, kernel in routes["all_reduce"].get("quantized", ()):
        parts.append(f"all_reduce of {' and '.join(QUANTIZED_DTYPES)} from {minimum} B: {kernel} (not exact)")
    return "; ".join(parts)
