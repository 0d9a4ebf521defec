"""Runs a test body in one process per GPU, with NCCL initialised, and fails
the calling test with the child's traceback. Bounded: a child that is still
running after `timeout_s` is killed and the test fails."""
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from tpcomm.topology import force_multicast_off



def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, fn, args, errors):
    import faulthandler

    faulthandler.enable()  # a crash prints the Python stack instead of vanishing
    force_multicast_off()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        fn(rank, world, *args)
        torch.cuda.synchronize()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def run(fn, *args, world=None, timeout_s=150):
    force_multicast_off()
    world = world or torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = mp.start_processes(_child, args=(world, _free_port(), fn, args, errors), nprocs=world,
                               join=False, start_method="spawn")
    import time
    deadline = time.monotonic() + timeout_s
    failure = None
    try:
        while not procs.join(timeout=1.0):
            if time.monotonic() > deadline:
                failure = f"GPU test still running after {timeout_s} s (killed)"
                break
    except ProcessException as e:  # raised in a child, or a child crashed
        failure = str(e)
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    if reports or failure:
        raise AssertionError("\n".join([failure or ""] + [f"--- rank {r} ---\n{tb}" for r, tb in reports]))
