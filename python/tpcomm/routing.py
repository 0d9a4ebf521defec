"""Which backend runs a call: pure functions of what every rank of a group
shares (op, dtype, byte sizes, the communicator's caps and world size, the
effective routing table), never of where a tensor lies in memory, so the ranks
of a group always pick the same kernel.

Which of tpcomm's kernels can take a call (refusal()) is the C core's
answer: its statement of each kernel's rules (csrc/core/limits.c, read once
per Caps) and its check of a call against them (tpc_kernel_check, through
ctypes, once per route memo key), the check it runs on every op, so a rule
is written once. route() walks the table's band for the size and,
where the band's kernel cannot take the call, the kernels it falls back to;
add_rms_norm() picks the fused op's route, norm_pattern() that of every
fusion pattern. The C core runs the kernel it is told.

Backends: "packet" (barrier-free, small sizes), "line" (the packet scheme in
128-byte lines, CUDA builds only: it rests on NVLink delivering a warp's
128-byte store whole), "two_shot" (all_reduce in lines, in two phases: each
rank sums one chunk and sends the sums to all; 2(n-1)/n of the input per rank
where "line" sends (n-1) times it), "bulk" (large sizes), "nccl"
(torch.distributed on the same group). Sizes: `nbytes` is the input bytes
per rank; `row` (all_gather) the bytes of one slice along the gathered dim
and everything after it."""
import collections
import functools
import math

from . import _constants as C
from . import _dtypes, _lib

KERNELS = ("packet", "line", "two_shot", "bulk")
BACKENDS = KERNELS + ("nccl",)
OPS = ("all_reduce", "all_gather", "reduce_scatter")
# The ops each kernel serves, for checking routing tables without the
# extension; tests/test_kernel_limits_cpu.py holds them to limits.c.
KERNEL_OPS = {"packet": OPS, "line": OPS, "two_shot": ("all_reduce",), "bulk": OPS}
LINE_PROTOCOL = ("line", "two_shot")  # kernels that rest on whole 128-byte stores
PACKET_SLOT_KERNELS = ("packet",) + LINE_PROTOCOL  # kernels whose data lives in the packet slots (packet_max_bytes)
ALGO_CODES = {"packet": C.TPC_ALGO_PACKET, "line": C.TPC_ALGO_LINE, "two_shot": C.TPC_ALGO_TWO_SHOT,
              "bulk": C.TPC_ALGO_BULK, "bulk_one_shot": C.TPC_ALGO_BULK_ONE_SHOT}
# The quantized all-reduce (csrc/kernels/all_reduce_quant.cuh), one kernel a
# mode: never a band's backend, only where Config.quantize turned it on
# (quantized()); not exact (docs/design.md bounds its error).
QUANTIZE_MODES = ("fp8", "int8", "int4")
QUANTIZED = tuple(f"quantized_{mode}" for mode in QUANTIZE_MODES)
QUANTIZED_DTYPES = ("float16", "bfloat16")
ALGO_CODES.update({"quantized_fp8": C.TPC_ALGO_QUANTIZED_FP8, "quantized_int8": C.TPC_ALGO_QUANTIZED_INT8,
                   "quantized_int4": C.TPC_ALGO_QUANTIZED_INT4})
OP_CODES = {"all_reduce": C.TPC_OP_ALL_REDUCE, "all_gather": C.TPC_OP_ALL_GATHER,
            "reduce_scatter": C.TPC_OP_REDUCE_SCATTER}
# The algorithms behind a routed kernel name, in order of preference: the
# first the C core's limits let run the op at the group's world size is the
# one called. "bulk" all_reduce is the one-shot stream at two ranks, the
# streamed two-shot from three on (limits.c says which takes which).
VARIANTS = {"bulk": (C.TPC_ALGO_BULK_ONE_SHOT, C.TPC_ALGO_BULK)}

# The backend of all_reduce's "fused_norm" row (routing_table.effective_routes)
# where its limit is the cost model's default, not the table's.
FUSED_NORM_MODELLED = "fused_cost_model"

# Where a band's kernel cannot take a call, the next of these that can does;
# NCCL when none can.
FALLBACKS = {"packet": ("packet", "bulk"), "line": ("line", "packet", "bulk"),
             "two_shot": ("two_shot", "line", "packet", "bulk"), "bulk": ("bulk", "packet")}


class Caps(collections.namedtuple("Caps", "world_size max_bytes packet_max_bytes platform")):
    """What a communicator with the custom path on can take: its world size,
    max_bytes (the output bytes of one op), packet_max_bytes (the input bytes
    per rank of a packet or line kernel: for reduce_scatter one rank's part),
    and the platform this build is for, C.TPC_PLATFORM_CUDA or
    C.TPC_PLATFORM_ROCM (a tpc_platform, as the C core's kernel limits take
    it: the line and quantized kernels and the FP8 epilogues are CUDA only)."""

    def __new__(cls, world_size, max_bytes, packet_max_bytes, platform):
        # a bool is an int: True would read as ROCm
        if type(platform) is not int or platform not in (C.TPC_PLATFORM_CUDA, C.TPC_PLATFORM_ROCM):
            raise ValueError(f"tpcomm: Caps.platform is C.TPC_PLATFORM_CUDA or C.TPC_PLATFORM_ROCM, not {platform!r}")
        return super().__new__(cls, world_size, max_bytes, packet_max_bytes, platform)


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


class Limits(collections.namedtuple("Limits", "code limits")):
    """One kernel's rules for one op, as the C core states them (limits: a
    tpc_kernel_limits, csrc/tpcomm.h), and the tpc_algo code it runs under."""

    @property
    def refused(self):
        return self.limits.refused


@functools.lru_cache(maxsize=64)
def limits(caps):
    """{(op, kernel): Limits} for a communicator of these caps, from the C
    core (tpc_kernel_limits_of): read once per Caps."""
    table = {}
    for op, op_code in OP_CODES.items():
        for kernel in KERNELS + QUANTIZED:
            for code in VARIANTS.get(kernel, (ALGO_CODES[kernel],)):
                got = _lib.kernel_limits(op_code, code, caps.world_size, caps.max_bytes, caps.packet_max_bytes,
                                         caps.platform)
                table[op, kernel] = Limits(code, got)
                if got.refused not in (C.TPC_KERNEL_NO_OP, C.TPC_KERNEL_NO_WORLD):
                    break
    return table


@functools.lru_cache(maxsize=64)
def norm_limits(caps):
    """The fused norm kernel family's limits (TPC_OP_ALL_REDUCE_NORM, the
    packet kernel) for a communicator of these caps, from the C core."""
    return _lib.kernel_limits(C.TPC_OP_ALL_REDUCE_NORM, C.TPC_ALGO_PACKET, caps.world_size, caps.max_bytes,
                              caps.packet_max_bytes, caps.platform)


def algo_code(op, kernel, caps):
    """The tpc_algo code the C core runs `kernel` of `op` under in a
    communicator of these caps."""
    return limits(caps)[op, kernel].code


def _check(op_code, algo, lim, dtype, chunk, row):
    """The C core's refusal of a call (tpc_kernel_check, pointers aside), or
    None; a dtype with no tpc_dtype is named as torch names it."""
    code = _dtypes.CODE.get(dtype, -1)
    why = _lib.kernel_check(lim, op_code, algo, code, chunk, row)
    if why is not None and code < 0 and lim.dtypes:
        return f"{dtype} is not reduced by tpcomm's kernels ({why})"
    return why


def _refusal(op, kernel, caps, dtype, nbytes, row):
    """Why `kernel` cannot take the call, or None: the C core's check on
    its limits. The chunk the core checks is what one rank sends: a
    reduce_scatter's part, which must split the input evenly first."""
    chunk = nbytes
    if op == "reduce_scatter":
        if nbytes % caps.world_size:
            return f"reduce_scatter of {nbytes} bytes does not split into {caps.world_size} equal parts"
        chunk = nbytes // caps.world_size
    lim = limits(caps)[op, kernel]
    return _check(OP_CODES[op], lim.code, lim.limits, dtype, chunk, row)


def refusal(op, kernel, caps, dtype, nbytes, row=0):
    """Why tpcomm's `kernel` cannot run this call (a sentence), or None when
    it can. caps None: the custom path is off."""
    if op not in OPS or kernel not in KERNELS:
        raise ValueError(f"tpcomm: no {kernel!r} kernel for {op!r} (ops {OPS}, kernels {KERNELS})")
    if caps is None:
        return "the custom path is off"
    return _refusal(op, kernel, caps, dtype, nbytes, row)


def quantized_refusal(caps, dtype, nbytes):
    """Why the quantized all-reduce cannot run an all_reduce, or None (its
    limits are the same in every mode)."""
    if caps is None:
        return "the custom path is off"
    return _refusal("all_reduce", QUANTIZED[0], caps, dtype, nbytes, 0)


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
    if caps is None:
        return "nccl"
    if op == "all_reduce":
        chosen = quantized(routes, caps, dtype, nbytes)
        if chosen:
            return chosen
    by_dtype = routes[op]
    backend = choose(by_dtype.get(_dtypes.NAME.get(dtype), by_dtype["*"]), nbytes)
    for kernel in FALLBACKS.get(backend, ()):
        if _refusal(op, kernel, caps, dtype, nbytes, row) is None:
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
    "fused" (one kernel, where the C core's check of the fused norm op
    passes: fp16/bf16, rows within its row limit, the input within the packet
    cap; and within fused_norm_max(routes)), "split" (reduce-scatter kernels
    when the rows divide among the ranks), else "unfused"."""
    if not (caps is not None and fused_kernel and weight_dtype == dtype and nbytes > 0 and row > 0):
        return "unfused"
    lim = norm_limits(caps)
    if nbytes <= fused_norm_max(routes) and norm_refusal(caps, dtype, nbytes, row) is None:
        return "fused"
    # split's rows are the fused kernels' rows: the same dtypes and row multiple
    takes_rows = lim.dtypes >> _dtypes.CODE.get(dtype, 64) & 1 and row % lim.multiple == 0
    if (takes_rows and (nbytes // row) % caps.world_size == 0
            and route(routes, caps, "reduce_scatter", dtype, nbytes) in KERNELS):
        return "split"
    return "unfused"


def norm_refusal(caps, dtype, nbytes, row):
    """Why the fused norm kernel family cannot take an input of nbytes per
    rank in rows of `row` bytes (the C core's sentence), or None."""
    return _check(C.TPC_OP_ALL_REDUCE_NORM, C.TPC_ALGO_PACKET, norm_limits(caps), dtype, nbytes, row)


def fused_norm_max(routes):
    """The largest input (bytes per rank) the routes let the fused norm kernel
    family take: their "fused_norm" row (routing_table.effective_routes); no
    limit without one."""
    row = routes["all_reduce"].get("fused_norm")
    return row[0][0] if row else math.inf


def norm_pattern(add_norm_route, pattern, weight_offset, dtype, *vector_dtypes, residual_scale=1.0):
    """How fusion pattern `pattern` (tpcomm.norm_patterns.Pattern) with this
    weight offset runs, from add_norm_route, what add_rms_norm() gives
    all_reduce_add_rms_norm of the same input and weight: every pattern runs
    on the fused kernel family (launch.cu instantiates each) where ADD_NORM would
    ("fused"; vector_dtypes, those of the next weight and the biases where
    given, None where not, all the input's dtype); ADD_NORM with weight w and
    residual_scale 1 is all_reduce_add_rms_norm itself, "split" included; the
    rest is "unfused" (all-reduce in fp32, then torch)."""
    unit = residual_scale == 1.0
    if int(pattern) == C.TPC_PATTERN_ADD_NORM and not weight_offset and unit:
        return add_norm_route
    if add_norm_route == "fused" and all(d in (None, dtype) for d in vector_dtypes):
        return "fused"
    return "unfused"


def norm_fp8(pattern_route, platform):
    """How a fusion pattern with an FP8 epilogue (tpcomm.norm_fp8) runs, from
    pattern_route, what norm_pattern() gives the pattern without it, and the
    build's platform (Caps.platform; None without the custom path): "fused"
    where that is "fused" and the platform C.TPC_PLATFORM_CUDA (the epilogues
    refuse on ROCm), else "unfused" ("split" and a group of one's route
    included)."""
    return "fused" if pattern_route == "fused" and platform == C.TPC_PLATFORM_CUDA else "unfused"


def summary(routes, caps):
    """The dispatch order of each op, as logged at init."""
    parts = []
    for op in OPS:
        bands = ", ".join(f"{backend} up to {limit} B" for limit, backend in routes[op]["*"])
        parts.append(f"{op}: {bands}, then nccl (caps: packet {caps.packet_max_bytes} B per rank, "
                     f"output {caps.max_bytes} B)")
    for minimum, kernel in routes["all_reduce"].get("quantized", ()):
        parts.append(f"all_reduce of {' and '.join(QUANTIZED_DTYPES)} from {minimum} B: {kernel} (not exact)")
    for largest, source in routes["all_reduce"].get("fused_norm", ()):
        parts.append(f"fused norm kernels up to {largest} B per rank within the packet cap "
                     f"({'cost-model default' if source == FUSED_NORM_MODELLED else 'table'})")
    return "; ".join(parts)
