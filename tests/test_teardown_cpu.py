"""The documented teardown (comm.close(), then dist.destroy_process_group())
ends a gloo group before interpreter exit: nothing of tpcomm's keeps the
group, and with it gloo's worker threads, alive, so none is left to abort
the process at exit (docs/design.md, Teardown; tpcomm._teardown says why a
thread left at exit can). Each test checks the group object is gone and its
worker threads joined, which needs no timing (only a new thread's name is
waited for): the abort itself is a race, counted by scripts/exit_stress.py
(docs/testing.md)."""
import inspect
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import tpcomm
from multiproc import run_ranks
import source_tree

sys.path.insert(0, os.path.join(source_tree.ROOT, "scripts"))
import exit_stress  # noqa: E402 - the README snippet on gloo, as the stress script runs it

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")


def thread_names():
    """Thread id -> name of this process's threads."""
    names = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[tid] = f.read().strip()
        except OSError:  # the thread ended while we looked
            pass
    return names


def gloo_worker_threads():
    """Thread ids of this process's gloo worker threads (ProcessGroupGloo names them)."""
    return {tid for tid, name in thread_names().items() if name == "pt_gloo_runloop"}


def _body_closed_communicator_lets_go(rank, world_size):
    """A closed Communicator, still referenced (a module-scope one is, until
    exit), holds nothing of its group: destroying the group joins its threads.
    The group's threads are the gloo ones whose ids are new since before
    new_group: every thread that exists then, named yet or not (a thread takes
    its name when it first runs, which on a loaded machine can be later), is
    another's."""
    before = set(thread_names())
    group = dist.new_group(list(range(world_size)))
    comm = tpcomm.Communicator(group, device="cpu")
    x = torch.ones(4 * world_size)
    comm.all_reduce(x)
    comm.all_gather(x, 0)
    comm.reduce_scatter(x, 0)
    comm.all_reduce_add_rms_norm(x.view(world_size, 4), x.view(world_size, 4), torch.ones(4))
    torch.ops.tpcomm.custom_all_reduce(x, comm.group_name)
    deadline = time.monotonic() + 30
    while not gloo_worker_threads() - before:  # one of the group's threads has run, so the check sees it
        assert time.monotonic() < deadline, "no gloo worker thread of the new group took its name within 30 s"
        time.sleep(0.01)
    comm.close()
    ref = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    assert ref() is None, "the process group outlives destroy_process_group: the closed Communicator holds it"
    left = gloo_worker_threads() - before
    assert not left, f"the group's gloo worker threads {sorted(left)} outlive its destruction"
    assert "closed" in repr(comm) and comm.group is None


def test_closed_communicator_holds_no_process_group():
    run_ranks(2, _body_closed_communicator_lets_go)


WORLD_AFTER_DESTROY = """
import sys, tempfile, weakref
{first}
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/store", rank=0, world_size=1)
{second}
print("torch.distributed.nn.functional imported at init:", "torch.distributed.nn.functional" in sys.modules)
import torch._dynamo  # what torch.compile and the functional collectives import, after the group exists
ref = weakref.ref(dist.group.WORLD)
dist.destroy_process_group()
print("world group alive after destroy:", ref() is not None)
"""


@pytest.mark.parametrize("tpcomm_first", [True, False], ids=["tpcomm-imported-first", "tpcomm-imported-after-init"])
def test_world_group_ends_with_destroy_after_dynamo_import(tpcomm_first):
    """torch.distributed.nn.functional binds group.WORLD as default arguments
    when first imported (torch._dynamo imports it): imported by tpcomm before
    any group exists, the world group goes with destroy_process_group().
    tpcomm imported after init_process_group leaves the module alone (its
    import then would pin the group)."""
    code = WORLD_AFTER_DESTROY.format(first="import tpcomm" if tpcomm_first else "",
                                      second="" if tpcomm_first else "import tpcomm")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=source_tree.subprocess_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if tpcomm_first:
        assert "world group alive after destroy: False" in proc.stdout, proc.stdout
    else:
        assert "torch.distributed.nn.functional imported at init: False" in proc.stdout, proc.stdout


def test_readme_core_snippet_ends_its_gloo_group(tmp_path):
    """The README's core snippet, on 2 gloo ranks under torchrun as a user
    runs it, leaves no gloo worker thread for interpreter exit."""
    script = tmp_path / "readme_core.py"
    script.write_text(exit_stress.readme_core(source_tree.ROOT) + "\n" + inspect.getsource(thread_names)
                      + inspect.getsource(gloo_worker_threads)
                      + "left = gloo_worker_threads()\n"
                      + "assert not left, f'{len(left)} gloo worker threads outlive the teardown'\n"
                      + "print('no gloo worker thread left')\n")
    proc = subprocess.run(exit_stress.TORCHRUN + [str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=source_tree.subprocess_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0 and proc.stdout.count("no gloo worker thread left") == 2, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
