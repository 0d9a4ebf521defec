"""Bandwidth figures of the measured rows (rows of at least
BANDWIDTH_MIN_BYTES per rank), with n ranks, b bytes per rank and t the
median time per op; GB/s means 1e9 bytes per second:

* algbw_gbps: the op's data over its time. all_reduce and reduce_scatter
  (b is its input): b / t. all_gather: n * b / t (the gathered output).
* link bytes: what each rank must at least send to its peers. all_reduce:
  2 * (n - 1) / n * b (reduce-scatter then all-gather); all_gather: (n - 1) * b;
  reduce_scatter: (n - 1) / n * b.
* peer_fraction: (link bytes / t) divided by the peer-copy bandwidth measured
  once at start (env["peer_copy_gbps"]: rank 0 copies 256 MiB from GPU 0 into
  GPU 1, median of 5). 1.0 means the op moves data across the link as fast
  as a plain one-way copy engine transfer.
"""
from .rows import finite_positive
from .vocabulary import MiB

BANDWIDTH_MIN_BYTES = 1 * MiB


def algbw_gbps(op, nbytes, world, median_us):
    """Data of the op over its time, GB/s (see the module docstring)."""
    data = nbytes * world if op == "all_gather" else nbytes
    return data / (median_us * 1e-6) / 1e9


def link_bytes(op, nbytes, world):
    """Bytes each rank must send to its peers at least."""
    if op == "all_gather":
        return (world - 1) * nbytes
    if op == "reduce_scatter":
        return (world - 1) / world * nbytes
    return 2.0 * (world - 1) / world * nbytes


def peer_fraction(op, nbytes, world, median_us, peer_gbps):
    """(link bytes / time) over the measured peer-copy bandwidth."""
    if not peer_gbps or peer_gbps <= 0:
        return None
    return link_bytes(op, nbytes, world) / (median_us * 1e-6) / (peer_gbps * 1e9)


def add_bandwidth(rows, world, peer_gbps):
    """Adds algbw_gbps (and peer_fraction where the peer copy was measured) to
    every row of at least BANDWIDTH_MIN_BYTES per rank with a valid time."""
    for r in rows:
        t = r.get("median_us")
        if r["bytes_per_rank"] < BANDWIDTH_MIN_BYTES or not finite_positive(t):
            continue
        r["algbw_gbps"] = round(algbw_gbps(r["op"], r["bytes_per_rank"], world, t), 2)
        pf = peer_fraction(r["op"], r["bytes_per_rank"], world, t, peer_gbps)
        if pf is not None:
            r["peer_fraction"] = round(pf, 3)
    return rows
