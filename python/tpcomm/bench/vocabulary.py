"""The benchmark's vocabulary: the ops, backends, modes and dtypes it knows,
the order tables and plots show them in, and how a byte count is written.
No torch: scripts/benchmark_tables.py loads this without the package."""

KiB = 1024
MiB = 1024 * KiB

OPS = ("all_reduce", "all_gather", "reduce_scatter")  # reduce_scatter's size: its input per rank
# The fused all-reduce + add + RMSNorm (pattern ADD_NORM) and its FP8
# epilogues (bench/norm_cases.py): inputs (tokens, hidden), rows with "hidden".
NORM_OPS = ("all_reduce_add_rms_norm", "all_reduce_add_rms_norm_fp8_per_tensor",
            "all_reduce_add_rms_norm_fp8_per_token", "all_reduce_add_rms_norm_fp8_per_token_group")
ALL_OPS = OPS + NORM_OPS
# Column order of the tables and plots.
BACKENDS = ("nccl", "nccl_nomix", "nccl_window", "nccl_window_nomix", "symm_one_shot", "symm_two_shot",
            "symm_two_shot_copied", "tpcomm", "tpcomm_packet", "tpcomm_line", "tpcomm_two_shot",
            "tpcomm_bulk", "tpcomm_quantized_fp8", "tpcomm_quantized_int8", "tpcomm_quantized_int4",
            "tpcomm_fused", "tpcomm_past_cap")
# NCCL reads NCCL_GRAPH_MIXING_SUPPORT once per process, at its first
# communicator: these run in a second set of processes with it set to 0 (NCCL
# at its fastest under CUDA graphs), graph mode only.
NOMIX_BACKENDS = ("nccl_nomix", "nccl_window_nomix")
NCCL_BACKENDS = ("nccl", "nccl_nomix", "nccl_window", "nccl_window_nomix")
BACKEND_HELP = {
    "nccl": "NCCL through torch.distributed on ordinary tensors",
    "nccl_nomix": "as nccl, in processes with NCCL_GRAPH_MIXING_SUPPORT=0 (graph mode only)",
    "nccl_window": "NCCL on tensors in a MemPool registered as a symmetric window (register_mem_pool(pool, symm=True))",
    "nccl_window_nomix": "as nccl_window, in processes with NCCL_GRAPH_MIXING_SUPPORT=0 (graph mode only)",
    "symm_one_shot": "torch.ops.symm_mem.one_shot_all_reduce on a SymmetricMemory buffer (all_reduce only)",
    "symm_two_shot": "torch.ops.symm_mem.two_shot_all_reduce_ on a SymmetricMemory buffer (all_reduce only)",
    "symm_two_shot_copied": "as symm_two_shot, with the input copied in and the result copied out, as a "
                            "dispatcher serving ordinary tensors (vLLM's SymmMemCommunicator) runs it",
    "tpcomm": "tpcomm.Communicator (the dispatcher's choice of kernel)",
    "tpcomm_packet": "tpcomm's packet kernel, forced",
    "tpcomm_line": "tpcomm's line kernel (128-byte lines of data and flag), forced",
    "tpcomm_two_shot": "tpcomm's two-phase all-reduce in lines (each rank sums one chunk), forced",
    "tpcomm_bulk": "tpcomm's bulk kernel, forced",
    "tpcomm_quantized_fp8": "tpcomm's quantized all-reduce, e4m3 codes, forced (not exact: within its error bound)",
    "tpcomm_quantized_int8": "tpcomm's quantized all-reduce, int8 codes, forced (not exact: within its error bound)",
    "tpcomm_quantized_int4": "tpcomm's quantized all-reduce, int4 codes, forced (not exact: within its error bound)",
    "tpcomm_fused": "tpcomm's fused all-reduce + add + RMSNorm kernel (with its FP8 epilogue), forced (norm ops only)",
    "tpcomm_past_cap": "the route tpcomm's dispatcher takes past the fused norm kernel's cap: split or unfused "
                       "(norm ops only)",
}
MODES = ("graph", "eager")
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "half": "float16",
                 "float16": "float16", "fp32": "float32", "float": "float32", "float32": "float32"}
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
NORM_HIDDEN = "4096,8192"  # the norm ops' default hidden sizes (--hidden)


def ordered(values, order):
    """The distinct values in `order`'s order, any others after them, sorted."""
    values = set(values)
    return [v for v in order if v in values] + sorted(values - set(order))


def human_bytes(n):
    """64 -> '64 B', 1024 -> '1 KiB', 3 * 2**20 -> '3 MiB', 1536 -> '1.5 KiB'."""
    n = int(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"
