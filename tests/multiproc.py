"""The one multi-process harness of tpcomm's tests (CPU and GPU).

run_ranks(world_size, body, *args) runs body(rank, world_size, *args) in
world_size spawned processes that have joined one torch.distributed group,
and fails the calling test (pytest.fail) unless every rank returns. It
guarantees:

* Bounded: a rank still running after `timeout` seconds is killed, and the
  failure names it and shows where it was (its Python stacks, dumped by
  faulthandler before the kill). Once a rank has failed, the others get
  FAILED_GRACE_S to finish or fail on their own and are then killed: a peer
  waiting for the failed rank never holds the test until the timeout.
* Forwarded: every failed rank's traceback, the first failure first; a rank
  that crashed (a signal, os._exit) is named with its exit status and the
  stacks faulthandler wrote when it crashed.
* NVLink multicast off in every rank (MULTICAST_OFF, forced, never merely
  defaulted), whatever the caller's environment says.
* One process group per run, on a FileStore in a temporary directory the
  parent removes afterwards: no TCP port picked in advance (one could be
  taken before rank 0 listened on it).

CPU ranks (devices=None) join a gloo group. GPU ranks (devices: a CUDA index
per rank) join an NCCL group unless the caller asks for gloo. run_gpu(body)
places ranks from the environment (gpu_placement): rank r on GPU r over NCCL,
or, with TPCOMM_SHARE_GPU=1 and more ranks than GPUs, rank r on GPU
r % count over gloo (NCCL refuses two ranks on one GPU), each rank calling
tpcomm._testing.allow_shared_gpu(True) so that its Communicator keeps the
custom path. TPCOMM_TEST_WORLD sets the number of ranks. TPCOMM_SHARE_GPU and
TPCOMM_TEST_WORLD are test-only variables: this module is the only reader.

The processes are started and waited for by tpcomm._ranks, the one rank
launcher of tpcomm's tools, examples and benchmarks; this module adds the
tests' side: the bodies' tracebacks, the stacks of hung ranks, pytest.fail.

This is a helper module, not a test module: test modules import it (pytest
puts tests/, the directory of conftest.py, on sys.path, and spawned ranks
inherit the parent's sys.path).
"""
import datetime
import faulthandler
import os
import signal
import sys
import time
import traceback

import pytest
from tpcomm import _ranks

# The project's rule, stated here rather than imported from tpcomm, so that no
# package change can turn multicast on in a test run without this list changing.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

RUN_TIMEOUT_S = 60
FAILED_GRACE_S = 5.0   # how long the other ranks may run after one failed
STACK_DUMP_WAIT_S = 1.0  # how long a hung rank gets to write its stacks before the kill
MAX_RANKS = 8          # the most ranks tpcomm's kernels take (csrc/tpcomm.h)
REPORT_CHARS = 6000    # of each rank's stacks in a failure message (the end is kept)



def force_multicast_off(environ=os.environ):
    environ.update(MULTICAST_OFF)


force_multicast_off()  # the importing process too; spawned ranks inherit it and force it again


# --------------------------------------------------------- test variables
def share_gpu(environ=os.environ):
    """TPCOMM_SHARE_GPU: may several ranks share one GPU (kernel tests on a
    machine with fewer GPUs than ranks)? Any value but a boolean raises."""
    from tpcomm.config import env_flag

    return env_flag("TPCOMM_SHARE_GPU", environ)


def world_from_env(environ=os.environ):
    """TPCOMM_TEST_WORLD: the number of ranks of the GPU tests (None when
    unset); an integer from 2 to MAX_RANKS, else ValueError."""
    raw = environ.get("TPCOMM_TEST_WORLD", "").strip()
    if not raw:
        return None
    try:
        world = int(raw)
    except ValueError:
        world = 0
    if not 2 <= world <= MAX_RANKS:
        raise ValueError(f"TPCOMM_TEST_WORLD={raw!r}: expected an integer from 2 to {MAX_RANKS}")
    return world


def gpu_placement(gpus, world=None, environ=os.environ):
    """(world, devices, backend) of a GPU run on `gpus` visible GPUs: `world`
    ranks if given, else TPCOMM_TEST_WORLD, else one per GPU (2 on one shared
    GPU). Rank r on GPU r over NCCL, or, where TPCOMM_SHARE_GPU=1 and there
    are more ranks than GPUs, on GPU r % gpus over gloo. ValueError when the
    ranks do not fit."""
    shared = share_gpu(environ)
    world = world or world_from_env(environ) or (gpus if gpus >= 2 else 2)
    if gpus < 1:
        raise ValueError("no CUDA GPU is visible")
    if world <= gpus:
        return world, list(range(world)), "nccl"
    if not shared:
        raise ValueError(f"{world} ranks need {world} GPUs ({gpus} visible), or TPCOMM_SHARE_GPU=1 to share them")
    return world, [r % gpus for r in range(world)], "gloo"


def gpu_skip_reason(gpus, environ=os.environ):
    """Why the GPU tests cannot run here (None when they can)."""
    try:
        gpu_placement(gpus, environ=environ)
    except ValueError as e:
        return (f"{e}: needs 2 or more CUDA GPUs, or one GPU with TPCOMM_SHARE_GPU=1 "
                f"(TPCOMM_TEST_WORLD=N ranks; docs/testing.md)")
    return None


def shared_placement(devices):
    """Do ranks of this placement share a GPU?"""
    return devices is not None and len(set(devices)) < len(devices)


# ------------------------------------------------------------------ ranks
def _rank_main(rank, world, init_method, backend, devices, body, args, env, timeout, tmp):
    """One rank: joins the group, runs the body, leaves. Leaves with os._exit,
    skipping interpreter teardown, where threads that torch.compile, the
    profiler or a ProcessGroupGloo left behind sometimes ended a rank with
    std::terminate after its work was done and checked."""
    stacks = open(os.path.join(tmp, f"rank{rank}.stacks"), "w")
    faulthandler.enable(file=stacks, all_threads=True)  # a crash leaves the Python stacks here
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the parent asks before killing
    device = None if devices is None else devices[rank]
    try:
        os.environ.update(env)
        force_multicast_off()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        extra = {}
        if device is not None:
            torch.cuda.set_device(device)
            if share_gpu():
                from tpcomm import _testing

                _testing.allow_shared_gpu(True)
            if backend == "nccl":
                extra["device_id"] = torch.device("cuda", device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout), **extra)
        body(rank, world, *args)
        if device is not None:
            torch.cuda.synchronize()  # a fault of the body's last kernels is the body's failure
        open(os.path.join(tmp, f"rank{rank}.returned"), "w").close()  # a rank killed after this waited for a peer
        dist.barrier()  # nobody leaves while a peer still needs it
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(tmp, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _read(path, limit=REPORT_CHARS):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return ""
    return text if len(text) <= limit else "...\n" + text[-limit:]


_exit_text = _ranks.exit_text


def run_ranks(world_size, body, *args, timeout=RUN_TIMEOUT_S, env=None, devices=None, backend=None,
              expect_killed=()):
    """Runs body(rank, world_size, *args) in world_size spawned ranks (see the
    module's docstring); returns when every rank returned, else fails the
    test. `env`: variables set in every rank before it joins the group (a
    variable read when a module is imported has the caller's value: the
    rank imports the body's module first).
    `devices`: a CUDA index per rank (None: CPU ranks). `backend`: gloo for
    CPU ranks, NCCL for GPU ranks unless given. `expect_killed`: ranks meant
    to die by a signal (their death is then no failure, their survival is)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if devices is not None and len(devices) != world_size:
        raise ValueError(f"{len(devices)} devices for {world_size} ranks")
    backend = backend or ("gloo" if devices is None else "nccl")
    expect_killed = set(expect_killed)
    with _ranks.rendezvous() as (init_method, tmp):
        procs = _ranks.start(world_size, _rank_main, init_method, backend, devices, body, args, dict(env or {}),
                             timeout, tmp)
        failed_order, hung, stopped, _ = _ranks.wait(procs, timeout, FAILED_GRACE_S, expect_killed=expect_killed,
                                                     before_kill=lambda ranks: _ask_for_stacks(procs, ranks))
        message = _report(procs, tmp, failed_order, hung, stopped, expect_killed, timeout)
    if message:
        pytest.fail(message, pytrace=False)


def _ask_for_stacks(procs, ranks):
    """Before the kill: each rank's faulthandler writes its Python stacks."""
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(STACK_DUMP_WAIT_S)


def _cause_first(failed, tmp):
    """The failed ranks, those that failed in their body first, each group in
    the order their tracebacks were written (a crash without one last): the
    first is the likeliest cause, the rest often peers that lost it."""
    def key(r):
        returned = os.path.exists(os.path.join(tmp, f"rank{r}.returned"))
        try:
            written = os.stat(os.path.join(tmp, f"rank{r}.error")).st_mtime_ns
        except OSError:
            written = float("inf")
        return (returned, written, r)
    return sorted(failed, key=key)


def _report(procs, tmp, failed_order, hung, stopped, expect_killed, timeout):
    """The failure message ('' when every rank did what it should)."""
    lines, details = [], []
    failed_order = _cause_first(failed_order, tmp)
    returned = [r for r in hung if os.path.exists(os.path.join(tmp, f"rank{r}.returned"))]
    in_body = [r for r in hung if r not in returned]
    if in_body:
        lines.append(f"rank{'s' if len(in_body) > 1 else ''} {', '.join(map(str, in_body))} did not finish within "
                     f"{timeout} s (killed)")
    if returned:
        lines.append(f"rank{'s' if len(returned) > 1 else ''} {', '.join(map(str, returned))} returned from the body "
                     f"but waited at the closing barrier past {timeout} s (killed)")
    if failed_order:
        lines.append(f"failed: rank {', rank '.join(map(str, failed_order))} (first to fail: rank {failed_order[0]})")
    if stopped:
        lines.append(f"stopped {FAILED_GRACE_S:g} s after rank {failed_order[0]} failed: "
                     f"rank {', rank '.join(map(str, stopped))}")
    for r in sorted(expect_killed):
        code = procs[r].exitcode
        if code is None or code >= 0:
            lines.append(f"rank {r} was meant to be killed by a signal but ended with {_exit_text(code)}")
    for r in failed_order:
        error = _read(os.path.join(tmp, f"rank{r}.error"))
        if error:
            details.append(f"--- rank {r} ---\n{error}")
        else:  # no Python exception: a crash, os._exit or a signal
            details.append(f"--- rank {r} ({_exit_text(procs[r].exitcode)}) ---\n"
                           + (_read(os.path.join(tmp, f"rank{r}.stacks")) or "(no stacks written)"))
    for r in hung + stopped:
        details.append(f"--- rank {r} ({'hung' if r in hung else 'stopped'}), its stacks ---\n"
                       + (_read(os.path.join(tmp, f"rank{r}.stacks")) or "(no stacks written)"))
    if not lines:
        return ""
    return "\n".join(lines + details)


def run_gpu(body, *args, world=None, timeout=150, expect_killed=(), backend=None, devices=None):
    """run_ranks on the GPUs of this machine, placed by gpu_placement (or on
    `devices` when given)."""
    import torch

    if devices is None:
        world, devices, placed_backend = gpu_placement(torch.cuda.device_count(), world)
        backend = backend or placed_backend
    else:
        world = len(devices)
    run_ranks(world, body, *args, timeout=timeout, devices=devices, backend=backend, expect_killed=expect_killed)


def gpus_shared(world=None):
    """Does a GPU run of `world` ranks (default: from the environment) place
    several ranks on one GPU here?"""
    import torch

    _, devices, _ = gpu_placement(torch.cuda.device_count(), world)
    return shared_placement(devices)
