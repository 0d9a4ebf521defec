"""python -m tpcomm.bench: tpcomm against NCCL on every visible GPU.

One process per GPU (spawned here, or one per rank under torchrun). For each
op, backend, dtype, size and mode it records the median time per op: "graph"
captures `--ops-per-graph` back-to-back ops in one CUDA graph and takes the
median over `--replays` replays divided by the op count; "eager" times the same
number of plain calls. Every backend is warmed up, checked against NCCL once,
and timed after a barrier; the figure kept is the slowest rank's median.
Writes a table to the terminal and JSON to benchmarks/results/<gpu>x<n>.json.
"""
import argparse
import os
import sys

from . import measure


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tpcomm.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="all_reduce,all_gather", help="comma-separated ops")
    p.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16,float16,float32")
    p.add_argument("--min-bytes", type=int, default=64, help="smallest size per rank")
    p.add_argument("--max-bytes", type=int, default=16 << 20, help="largest size per rank")
    p.add_argument("--modes", default="graph,eager")
    p.add_argument("--backends", default=None,
                   help="comma-separated subset of: " + ",".join(measure.BACKENDS))
    p.add_argument("--ops-per-graph", type=int, default=50)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<gpu>x<n>.json)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and replays (smoke run)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    for k, v in measure.MULTICAST_OFF.items():
        os.environ[k] = v
    import torch

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        measure.worker(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])), int(os.environ["WORLD_SIZE"]),
                       None, args)
        return 0
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        print(measure.environment_text(n))
        print(f"tpcomm.bench needs at least 2 CUDA GPUs on this machine; found {n}. Nothing to measure.")
        return 0
    import torch.multiprocessing as mp

    mp.spawn(measure.worker, args=(n, measure.free_port(), args), nprocs=n, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
