"""Host cost of one eager collective call: how many microseconds of CPU time
the Python call path spends before the GPU could start, at 64 KiB bf16, for
Communicator.all_reduce, the group-name op, the internal op and the layers
below them.

    python benchmarks/host_cost.py [--bytes 65536] [--calls 2000] [--rounds 15]

Each rank issues --calls back-to-back calls and times the host loop with
perf_counter, without synchronising inside it. The kernels are shorter than
the host cost measured, so the GPU never holds the host back and the loop
time is the host's own; the figure is the median over rounds of the
loop time per call, rank 0's and rank 1's side by side. Every round times
every path (host_us_per_call). Writes JSON (--out).
"""
import argparse
import ctypes
import json
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpcomm import _ranks
from tpcomm.bench.environment import environment
from tpcomm.bench.timing import rotated


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=int, default=64 << 10, help="bytes per rank (default 64 KiB)")
    p.add_argument("--calls", type=int, default=2000, help="calls per timed loop")
    p.add_argument("--rounds", type=int, default=15, help="timed loops per path (median)")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    return p.parse_args(argv)


def paths(comm, x):
    """name -> a no-argument call issuing one all_reduce of x."""
    from tpcomm import _dtypes
    from tpcomm import routing

    route = comm.route_all_reduce(x)
    algo = routing.algo_code("all_reduce", route, comm._caps) if route in routing.KERNELS else None
    out = {
        "Communicator.all_reduce": lambda: comm.all_reduce(x),
        "torch.ops.tpcomm.custom_all_reduce (dispatcher op, group name)":
            lambda: torch.ops.tpcomm.custom_all_reduce(x, comm.group_name),
        "torch.distributed.all_reduce (NCCL, in place)": lambda: dist.all_reduce(x),
    }
    if algo is not None:
        out["torch.ops._tpcomm.all_reduce (internal op, id and kernel)"] = \
            lambda: torch.ops._tpcomm.all_reduce(x, comm.comm_id, algo)
        # Where the internal op's time goes: the same call on its OpOverload,
        # the out= variant (no allocation), and the C core alone through ctypes.
        raw = torch.ops._tpcomm.all_reduce.default
        raw_out = torch.ops._tpcomm.all_reduce_out.default
        y = torch.empty_like(x)
        out["  .default overload"] = lambda: raw(x, comm.comm_id, algo)
        out["  all_reduce_out.default (no allocation)"] = lambda: raw_out(x, y, comm.comm_id, algo)
        c_all_reduce = comm._lib.tpc_all_reduce
        c_all_reduce.restype = ctypes.c_int
        c_all_reduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_void_p]
        args = (comm._comm, x.data_ptr(), y.data_ptr(), x.nbytes, _dtypes.CODE[x.dtype], algo,
                torch.cuda.current_stream().cuda_stream)
        out["  C core alone (tpc_all_reduce through ctypes)"] = lambda: c_all_reduce(*args)
        # The eager fast path (tpcomm._fastpath, what the memoised route's
        # callable takes for aligned tensors) beside the _out op it replaces,
        # both behind the same Kernels.all_reduce_runner, and the fast path's
        # C call alone.
        from tpcomm.backends.kernels import Kernels
        through_op = Kernels(comm.comm_id, x.get_device(), comm._caps)
        through_op._fastpath = None
        run, run_op = comm.kernels.all_reduce_runner(x.dtype, route), through_op.all_reduce_runner(x.dtype, route)
        out["  the route's callable, fast path"] = lambda: run(x)
        out["  the route's callable, the _out op instead"] = lambda: run_op(x)
        fast = comm.kernels._fastpath
        if fast is not None:
            fast_args = (comm.comm_id, *args[1:])  # the id instead of the pointer
            out["  tpcomm._fastpath.all_reduce alone (no allocation)"] = lambda: fast.all_reduce(*fast_args)
    z = torch.zeros_like(x)
    out["reference: z.add_(1.0), one native torch kernel"] = lambda: z.add_(1.0)
    out["reference: torch.empty_like(x)"] = lambda: torch.empty_like(x)
    out["reference: an empty Python call"] = lambda: None
    return out


def host_us_per_call(calls_by_name, calls, rounds):
    """name -> (median, min) us per call. Rounds are interleaved: each round
    times every path once, starting one path further on, so a host that slows
    down or speeds up over the run (they do, by a third) weighs on every path
    alike instead of on whichever ran then."""
    names = list(calls_by_name)
    for name in names:
        for _ in range(50):
            calls_by_name[name]()
    torch.cuda.synchronize()
    dist.barrier()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            call = calls_by_name[name]
            torch.cuda.synchronize()
            times[name].append(_ranks.seconds_per_call(call, calls, "cpu") * 1e6)  # the host's clock
    torch.cuda.synchronize()
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def worker(rank, world, init_method, args, queue):
    from tpcomm.topology import force_multicast_off

    force_multicast_off()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    import tpcomm
    comm = tpcomm.Communicator(dist.group.WORLD)
    if not comm.enabled:
        raise SystemExit(f"tpcomm: custom path off on rank {rank}: {comm.disabled_reason}")
    x = torch.ones(args.bytes // 2, device="cuda", dtype=torch.bfloat16)
    rows = {name: {"median_us": round(med, 2), "min_us": round(best, 2)}
            for name, (med, best) in host_us_per_call(paths(comm, x), args.calls, args.rounds).items()}
    result = {"rank": rank, "route": comm.route_all_reduce(x), "rows": rows}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        queue.put(gathered)
    comm.close()
    dist.destroy_process_group()


def main(argv=None):
    from tpcomm.topology import force_multicast_off

    args = parse_args(argv)
    force_multicast_off()  # forced, never merely defaulted; the ranks inherit it
    world = torch.cuda.device_count()
    if world < 2:
        sys.exit("host_cost: needs 2 or more GPUs")
    queue = mp.get_context("spawn").SimpleQueue()
    with _ranks.rendezvous() as (init_method, _):
        procs = _ranks.start(world, worker, init_method, args, queue)
        outcome = _ranks.wait(procs, 600)
    if outcome.failed or outcome.hung:
        sys.exit(f"host_cost: ranks {outcome.failed + outcome.hung} failed or hung (their output is above)")
    ranks = queue.get()
    env = environment(world)
    print(f"host cost per eager call, {args.bytes} B bf16, {world} ranks, route {ranks[0]['route']}:")
    for name in ranks[0]["rows"]:
        cells = "  ".join(f"rank{r['rank']} {r['rows'][name]['median_us']:6.2f} us" for r in ranks)
        print(f"  {name:58s} {cells}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "bytes": args.bytes, "dtype": "bfloat16", "calls": args.calls,
                       "rounds": args.rounds, "ranks": ranks}, f, indent=1)


if __name__ == "__main__":
    main()
