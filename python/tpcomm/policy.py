"""Which backend runs an op of a given size: data, not code.

Each table maps a world size to a list of (largest input bytes per rank,
backend), tried in order; sizes past the last entry go to NCCL. Backends:
"packet" and "bulk" are tpcomm's kernels (csrc/kernels), "nccl" is
torch.distributed on the same group. The 2-GPU rows come from
benchmarks/results/h200x2.json (CUDA graphs, median per op); other world
sizes keep the packet kernel to smaller sizes, where its (n-1)-fold traffic
per rank is still cheaper than a barrier.
"""
KiB = 1024
MiB = 1024 * KiB

ALL_REDUCE = {
    2: [(1 * MiB, "packet"), (16 * MiB, "bulk")],
    "other": [(64 * KiB, "packet"), (16 * MiB, "bulk")],
}
ALL_GATHER = {
    2: [(1 * MiB, "packet"), (16 * MiB, "bulk")],
    "other": [(64 * KiB, "packet"), (16 * MiB, "bulk")],
}
TABLES = {"all_reduce": ALL_REDUCE, "all_gather": ALL_GATHER}


def choose(op, world_size, nbytes, tables=TABLES):
    """Backend name for `op` with `nbytes` of input per rank."""
    rows = tables[op].get(world_size, tables[op]["other"])
    for limit, backend in rows:
        if nbytes <= limit:
            return backend
    return "nccl"


def packet_cutover(op, world_size, tables=TABLES):
    """Largest size the table sends to the packet kernel (the C core's AUTO)."""
    rows = tables[op].get(world_size, tables[op]["other"])
    return max((limit for limit, backend in rows if backend == "packet"), default=0)
