"""The ranks of one torch.distributed group on this host, and the one timer.

Every program of tpcomm that runs ranks itself (`tpcomm bench`, `tpcomm
tune`, `tpcomm doctor`'s self-test, the examples, the benchmark scripts and
the tests' harness, tests/multiproc.py) starts them here:

    with rendezvous() as init_method:
        procs = start(world, target, init_method, *args)   # target(rank, world, init_method, *args)
        outcome = wait(procs, timeout_s)

* One process per rank, started by `spawn` (a fresh interpreter: no CUDA
  state inherited), with NVLink multicast off (topology.MULTICAST_OFF) in the
  parent and so in every rank.
* The ranks meet on a FileStore in a temporary directory that rendezvous()
  removes afterwards: no TCP port picked in advance (another process could
  take it before rank 0 listens on it).
* wait() is bounded: ranks still running at the deadline are killed (hung);
  once one rank has failed the others get `grace_s` and are then killed
  (stopped), so a peer waiting for a dead rank never holds the caller; once
  `done()` says the work is written the ranks get `grace_s` to leave and are
  then killed (lingered: a teardown hang costs no results).

seconds_per_call() is the one timer of tpcomm's measurements: CUDA events
around back-to-back calls on a GPU, the host's perf_counter on the CPU.
"""
import collections
import contextlib
import os
import signal
import tempfile
import time

from . import topology

Outcome = collections.namedtuple("Outcome", "failed hung stopped lingered")
Outcome.__doc__ = """What wait() saw: the failed ranks in the order seen, and the ranks it
killed (hung: past the deadline; stopped: after another failed; lingered:
after done())."""

POLL_S = 0.1


@contextlib.contextmanager
def rendezvous(prefix="tpcomm-ranks-"):
    """An init_method (file://) for one group, in a temporary directory
    removed when the block ends; yields (init_method, directory)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield "file://" + os.path.join(tmp, "store"), tmp


def start(world, target, init_method, *args):
    """Starts `world` spawned processes running target(rank, world,
    init_method, *args); returns them, rank order."""
    import torch.multiprocessing as mp

    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    topology.force_multicast_off()  # the ranks inherit it
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, init_method, *args), daemon=False) for r in range(world)]
    for p in procs:
        p.start()
    return procs


def _failed(rank, proc, expect_killed):
    code = proc.exitcode
    if code is None:
        return False
    if rank in expect_killed:  # its death by a signal is expected; an exception of its own is not
        return code > 0
    return code != 0


def wait(procs, timeout_s, grace_s=5.0, done=None, expect_killed=(), before_kill=None):
    """Waits for the ranks (see the module's docstring) and returns an
    Outcome. `before_kill(ranks)` runs before ranks are killed (e.g. asks
    them for their stacks); `expect_killed`: ranks meant to die by a signal."""
    expect_killed = set(expect_killed)
    deadline = time.monotonic() + timeout_s
    failed, grace_end, finished_at = [], None, None
    hung, stopped, lingered = [], [], []
    while True:
        for r, p in enumerate(procs):
            if r not in failed and _failed(r, p, expect_killed):
                failed.append(r)
                grace_end = grace_end or time.monotonic() + grace_s
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        if not alive:
            break
        now = time.monotonic()
        if finished_at is None and done is not None and done():
            finished_at = now
        if now > deadline:
            hung = alive
            break
        if grace_end is not None and now > grace_end:
            stopped = alive
            break
        if finished_at is not None and now > finished_at + grace_s:
            lingered = alive
            break
        time.sleep(POLL_S)
    killed = hung + stopped + lingered
    if killed and before_kill is not None:
        before_kill(killed)
    stop([procs[r] for r in killed])
    for p in procs:
        p.join(10)
    for r, p in enumerate(procs):  # ranks that failed while the others were being stopped
        if r not in failed and r not in killed and _failed(r, p, expect_killed):
            failed.append(r)
    return Outcome(failed, hung, stopped, lingered)


def stop(procs, term_wait_s=0.0):
    """Kills the processes still alive (SIGTERM first where term_wait_s > 0)."""
    if term_wait_s > 0:
        for p in procs:
            if p.is_alive():
                p.terminate()
        end = time.monotonic() + term_wait_s
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(10)


def exit_text(code):
    """A process's exit as words ("exit status 1", "killed by SIGKILL")."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def seconds_per_call(fn, calls, device):
    """Seconds per call of `calls` back-to-back fn() calls, timed once: CUDA
    events on the current stream of a CUDA device (the GPU's time, launches
    queued back to back), the host clock otherwise. Warm-ups are the
    caller's."""
    if getattr(device, "type", device) != "cuda":
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - begin) / calls
    import torch

    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000.0 / calls
