"""What the fallback's agreement check (tpcomm._agreement) costs a call on
gloo: 2 CPU ranks, a Communicator with the check on and one with it off on
groups of their own, each timing back-to-back calls of every op at a few
sizes, the two in alternating rounds; the median over rounds of µs per call.

    python benchmarks/fallback_check_cost.py [--rounds 7] [--calls 200] [--out FILE]
"""
import argparse
import datetime
import os
import statistics
import sys

import torch
import torch.distributed as dist

import tpcomm
from tpcomm import _ranks

SIZES = (64, 4096, 1 << 20)  # bytes of fp32 per rank
OPS = {"all_reduce": lambda comm, x: comm.all_reduce(x),
       "all_gather": lambda comm, x: comm.all_gather(x, 0),
       "reduce_scatter": lambda comm, x: comm.reduce_scatter(x, 0)}


def rank_main(rank, world, init_method, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    comms = {on: tpcomm.Communicator(dist.new_group(list(range(world))), device="cpu",
                                     config=tpcomm.Config(fallback_check=on)) for on in (False, True)}
    times = {}  # (op, bytes, on) -> [µs per call, a round each]
    for r in range(args.rounds + 1):  # round 0 warms up
        for on in ((False, True) if r % 2 else (True, False)):
            for op, call in OPS.items():
                for nbytes in SIZES:
                    x = torch.ones(nbytes // 4)
                    dist.barrier()
                    s = _ranks.seconds_per_call(lambda: call(comms[on], x), args.calls, torch.device("cpu"))
                    if r:
                        times.setdefault((op, nbytes, on), []).append(s * 1e6)
    for comm in comms.values():
        comm.close()
    if rank == 0:
        lines = [f"# benchmarks/fallback_check_cost.py: {datetime.date.today()}, torch {torch.__version__}, "
                 f"{world} gloo ranks, {os.cpu_count()} CPUs; median of {args.rounds} rounds of {args.calls} calls",
                 f"{'op':16s} {'bytes/rank':>10s} {'off µs':>9s} {'on µs':>9s} {'added µs':>9s}"]
        for op in OPS:
            for nbytes in SIZES:
                off, on = (statistics.median(times[(op, nbytes, o)]) for o in (False, True))
                lines.append(f"{op:16s} {nbytes:10d} {off:9.1f} {on:9.1f} {on - off:9.1f}")
        text = "\n".join(lines) + "\n"
        print(text, end="")
        if out:
            with open(out, "w") as f:
                f.write(text)
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out")
    args = p.parse_args(argv)
    with _ranks.rendezvous() as (init_method, _):
        outcome = _ranks.wait(_ranks.start(2, rank_main, init_method, args, args.out), timeout_s=1800)
    return 1 if outcome.failed or outcome.hung else 0


if __name__ == "__main__":
    sys.exit(main())
