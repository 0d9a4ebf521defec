"""all_reduce_add_rms_norm per route at decode and prefill sizes, side by side
with NCCL doing what a serving engine's unfused layer does (a bf16 all-reduce,
then the add and the norm in fp32). CUDA graphs of 10 back-to-back calls,
median over 20 replays, slowest rank, µs per call.

    python benchmarks/add_rms_norm_routes.py [--out results.json]

Routes: "fused" (one kernel, up to the packet cap), "split" (reduce-scatter
in fp32, the norm on a rank's rows, all-gather), "unfused" (an fp32
all-reduce through the dispatcher, then torch); each row runs the route that
the Communicator picks, and "unfused" again where another route was picked."""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import graph_timing  # noqa: E402 - beside this file; it imports the checkout's tpcomm (the line above)

SHAPES = [(1, 4096), (32, 4096), (128, 4096), (512, 4096), (1024, 4096), (2048, 4096)]
EPS = 1e-5


def _nccl_layer(x, residual, weight):
    """A serving layer's unfused step on NCCL: the all-reduce rounded to x's dtype, then the add and the norm."""
    from tpcomm.add_rms_norm import from_sums

    y = x.clone()
    dist.all_reduce(y)
    return from_sums(y.float(), residual, weight, EPS, x.dtype)


def _rank(rank, world, init_method, out):
    import tpcomm
    from tpcomm.topology import force_multicast_off

    force_multicast_off()
    from tpcomm.add_rms_norm import from_sums

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    comm = tpcomm.Communicator()
    assert comm.enabled, comm.disabled_reason
    rows = []
    for tokens, hidden in SHAPES:
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        residual = torch.randn_like(x)
        weight = torch.rand(hidden, device="cuda").to(torch.bfloat16) + 0.5
        route = comm.route_all_reduce_add_rms_norm(x, weight)
        timed = {"nccl (bf16 all-reduce, then add + norm)": lambda: _nccl_layer(x, residual, weight)}
        timed[f"tpcomm {route}"] = lambda: comm.all_reduce_add_rms_norm(x, residual, weight, EPS)
        if route != "unfused":  # what the unfused route runs (Communicator.all_reduce_add_rms_norm)
            timed["tpcomm unfused"] = lambda: from_sums(comm.all_reduce(x.float()), residual, weight, EPS, x.dtype)
        row = {"tokens": tokens, "hidden": hidden, "bytes": x.numel() * 2, "route": route, "us": {}}
        with comm.capture():
            for name, fn in timed.items():
                row["us"][name] = graph_timing.slowest_rank_us(fn)
        rows.append(row)
        graph_timing.print_row(rank, f"{tokens:5d} x {hidden}", row)
    graph_timing.finish(comm, rank, world, rows, out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        print("needs 2 GPUs")
        return
    graph_timing.spawn("add_rms_norm_routes", world, _rank, args.out, 600)


if __name__ == "__main__":
    main()
