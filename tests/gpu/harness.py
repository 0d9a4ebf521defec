"""Runs a test body in one process per rank, with torch.distributed
initialised, and fails the calling test with the child's traceback. Bounded:
a child that is still running after `timeout_s` is killed and the test fails.

By default rank r runs on GPU r over NCCL. `devices` places ranks on GPUs
(several ranks may share one), `backend="gloo"` keeps NCCL out (for tests
where a rank dies and NCCL's own teardown would wait for it), and
`expect_killed` names ranks that are meant to die by a signal.

With TPCOMM_SHARE_GPU=1 on a one-GPU machine every rank runs on GPU 0 over
gloo (NCCL refuses two ranks on one GPU) and the Communicator keeps its
custom path there (Config.share_gpu): the kernels' results can be checked on
one GPU, their speed cannot (the ranks' kernels time-slice).
TPCOMM_TEST_WORLD sets how many ranks (2 unless set): 4 and 8 check the
kernels at those world sizes before a machine with that many GPUs is lent."""
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpcomm.bench.measure import rendezvous
from tpcomm.topology import force_multicast_off


def _child(rank, world, init_method, fn, args, errors, backend, device):
    import faulthandler

    faulthandler.enable()  # a crash prints the Python stack instead of vanishing
    force_multicast_off()
    torch.cuda.set_device(device)
    extra = {"device_id": torch.device("cuda", device)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, **extra)
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


def one_gpu_mode():
    """Ranks share the only GPU (TPCOMM_SHARE_GPU=1 with one GPU visible)."""
    from tpcomm.topology import env_flag

    return env_flag("TPCOMM_SHARE_GPU") and torch.cuda.device_count() == 1


def run(fn, *args, world=None, timeout_s=150, devices=None, backend="nccl", expect_killed=()):
    force_multicast_off()
    if one_gpu_mode():
        world = world or int(os.environ.get("TPCOMM_TEST_WORLD", "2"))
        devices, backend = [0] * world, "gloo"
    world = world or torch.cuda.device_count()
    devices = list(devices) if devices is not None else list(range(world))
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    init_method = rendezvous()
    procs = [ctx.Process(target=_child, args=(r, world, init_method, fn, args, errors, backend, devices[r]), daemon=False)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    failure = None
    try:
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                failure = f"GPU test still running after {timeout_s} s (killed)"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    bad_exits = [f"rank {r} exited with {p.exitcode}" for r, p in enumerate(procs)
                 if p.exitcode != 0 and not (r in expect_killed and p.exitcode is not None and p.exitcode < 0)]
    missing_kills = [f"rank {r} was meant to be killed but exited with {procs[r].exitcode}"
                     for r in expect_killed if procs[r].exitcode is None or procs[r].exitcode >= 0]
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    if reports or failure or bad_exits or missing_kills:
        raise AssertionError("\n".join([failure or ""] + bad_exits + missing_kills
                                       + [f"--- rank {r} ---\n{tb}" for r, tb in reports]))
