"""How tpcomm.bench times a case: CUDA graphs of back-to-back calls replayed
in rounds (each backend of one size timed over the same seconds), or plain
eager calls; median microseconds per op."""
import statistics

import torch
import torch.distributed as dist

from .. import _ranks
from .cases import describe


def barrier():
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def rotated(items, r):
    """items in round r's order: starting r places further on, so that over
    len(items) rounds each goes first once."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def capture_graph(call, ops_per_graph):
    """A CUDA graph of `ops_per_graph` back-to-back calls (warmed up eagerly
    on a side stream first, as torch's graph capture asks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops_per_graph):
            call()
    return graph


def time_graphs(calls, ops_per_graph, replays, settle=0):
    """[(median us per op, None) or (nan, error text)] for each call, each
    captured in a graph of `ops_per_graph` ops, after 3 untimed replays of
    each. With one call: `replays` timed replays in a row. With several
    (the benchmark's default; --sequential times one call at a time):
    rounds, each replaying every graph in an order rotated by one, so the
    backends compared at one size are timed over the same seconds; `settle`
    untimed replays of a graph come before its timed one,
    since a graph replayed right after another backend's ran up to 1.6x
    slower (seen on 2xH200: a graph that always followed an NCCL graph)."""
    out = [None] * len(calls)
    graphs = {}
    for i, call in enumerate(calls):
        try:
            graphs[i] = capture_graph(call, ops_per_graph)
        except Exception as e:  # noqa: BLE001 - that backend's row becomes a reason
            out[i] = (float("nan"), describe(e))
    live = list(graphs)
    times = {i: [] for i in live}
    try:
        for _ in range(3):
            for i in live:
                graphs[i].replay()
        barrier()
        for r in range(replays):
            for i in rotated(live, r):
                for _ in range(settle):
                    graphs[i].replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graphs[i].replay()
                end.record()
                end.synchronize()
                times[i].append(start.elapsed_time(end) * 1000.0 / ops_per_graph)
    except Exception as e:  # noqa: BLE001 - a replay failed: no row of this size is trusted
        for i in live:
            out[i] = (float("nan"), f"replays failed: {describe(e)}")
        return out
    finally:
        graphs.clear()
    for i in live:
        out[i] = (statistics.median(times[i]), None)
    return out


def time_eager(call, ops, reps):
    """Median us per op over `reps` runs of `ops` back-to-back calls."""
    for _ in range(3):
        call()
    barrier()
    device = torch.device("cuda", torch.cuda.current_device())
    return statistics.median(_ranks.seconds_per_call(call, ops, device) * 1e6 for _ in range(reps))
