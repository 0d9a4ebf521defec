"""A cost model of tpcomm's all-reduce kernels: a fixed latency per kernel
and world size, plus the bytes each rank sends over its links at one
bandwidth. Pure Python over a benchmark's rows (no torch), read by
scripts/benchmark_tables.py for docs/benchmarks.md.

What each rank sends for an all_reduce of S bytes at world size n:
  packet    2 S (n-1)             16-byte packets carry 8 data bytes, to every peer
  line      8/7 S (n-1)           128-byte lines carry 112, to every peer
  two_shot  2 * 8/7 S (n-1) / n   its chunks' lines out, then its chunk's sums to all
  bulk      S (n = 2, one-shot), else 2 S (n-1) / n (two-shot)
"""

LINE_BYTES_PER_DATA_BYTE = 128 / 112
KERNELS = ("packet", "line", "two_shot", "bulk")


def egress_bytes(kernel, nbytes, world):
    """Bytes one rank sends for an all_reduce of nbytes per rank."""
    peers = world - 1
    if kernel == "packet":
        return 2 * nbytes * peers
    if kernel == "line":
        return LINE_BYTES_PER_DATA_BYTE * nbytes * peers
    if kernel == "two_shot":
        return 2 * LINE_BYTES_PER_DATA_BYTE * nbytes * peers / world
    if kernel == "bulk":
        return nbytes if world == 2 else 2 * nbytes * peers / world
    raise ValueError(f"no model for {kernel!r} (kernels {KERNELS})")


def times(rows, kernel, dtype="bfloat16"):
    """{bytes per rank: median us} of tpcomm's forced kernel, all_reduce,
    CUDA graphs, correct rows only."""
    return {r["bytes_per_rank"]: r["median_us"] for r in rows
            if (r["op"], r["backend"], r["dtype"], r["mode"]) == ("all_reduce", f"tpcomm_{kernel}", dtype, "graph")
            and r.get("correct") and isinstance(r.get("median_us"), (int, float))}


def fit(measured, kernel, world):
    """(latency us, GB/s): the latency is the time at the smallest size, the
    bandwidth what the largest size sends in the time beyond it."""
    small, large = min(measured), max(measured)
    latency = measured[small]
    return latency, egress_bytes(kernel, large, world) / (measured[large] - latency) / 1e3


def predict(latency_us, gbps, kernel, nbytes, world):
    return latency_us + egress_bytes(kernel, nbytes, world) / (gbps * 1e3)


def worst_error(measured, kernel, world, from_bytes):
    """The largest |model - measured| / measured over sizes from from_bytes on."""
    latency, gbps = fit(measured, kernel, world)
    return max(abs(predict(latency, gbps, kernel, n, world) - t) / t for n, t in measured.items() if n >= from_bytes)


def two_shot_pays_from(world, gbps, hop_us):
    """Bytes per rank from which two_shot sends enough less than line to pay
    for its second hop: 8/7 S (n-1) (1 - 2/n) / B > hop."""
    saved_per_byte = LINE_BYTES_PER_DATA_BYTE * (world - 1) * (1 - 2 / world)
    return float("inf") if saved_per_byte <= 0 else hop_us * gbps * 1e3 / saved_per_byte
