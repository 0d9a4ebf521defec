"""What the Python benchmarks of benchmarks/ share: a CUDA graph's time per
call over the ranks, and the environment a result file records."""
import datetime
import json
import statistics
import subprocess

import torch
import torch.distributed as dist

from tpcomm import _ranks


def driver():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.split()[0]
    except Exception:  # noqa: BLE001 - the driver version is a note, not a requirement
        return None


def slowest_rank_us(fn, calls=10, replays=20, warmup=1):
    """µs per call of fn: a CUDA graph of `calls` back-to-back calls, the
    median over `replays` replays (every rank starting together), the
    slowest rank's. warmup eager calls first (inductor's kernels compile and
    autotune on their first calls, which a capture must not see)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        times.append(_ranks.seconds_per_call(graph.replay, 1, torch.device("cuda")) * 1e6 / calls)
    worst = [None] * dist.get_world_size()
    dist.all_gather_object(worst, statistics.median(times))
    return round(max(worst), 2)


def environment(method, **extra):
    """A result file's environment: GPU, driver, torch, NCCL, date, how it was
    measured, and what else the benchmark adds."""
    return {"gpu": torch.cuda.get_device_name(), "driver": driver(), "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "date": datetime.date.today().isoformat(),
            "method": method, **extra}


def write(out, rows, env):
    """rows with their environment, as JSON in out."""
    with open(out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


def print_row(rank, label, row):
    """Rank 0 prints a row's times as it has them."""
    if rank == 0:
        print(f"{label}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["us"].items()), flush=True)


def finish(comm, rank, world, rows, out):
    """Rank 0 writes the rows to out (if given); every rank closes comm and leaves the group."""
    if rank == 0 and out:
        write(out, rows, environment("CUDA graph of 10 back-to-back calls, median over 20 replays, slowest rank, "
                                     "us per call", world_size=world))
    comm.close()
    dist.destroy_process_group()


def spawn(name, world, target, out, timeout_s):
    """target(rank, world, init_method, out) in `world` processes; exits naming the ranks that failed or hung."""
    import sys

    with _ranks.rendezvous() as (init_method, _):
        outcome = _ranks.wait(_ranks.start(world, target, init_method, out), timeout_s)
    if outcome.failed or outcome.hung:
        sys.exit(f"{name}: ranks {outcome.failed + outcome.hung} failed or hung (output above)")
