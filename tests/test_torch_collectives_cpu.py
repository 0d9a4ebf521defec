"""tpcomm.install(group) on 2 gloo ranks: the group's dist.all_reduce,
all_gather_into_tensor and reduce_scatter_tensor (and the legacy
_all_gather_base / _reduce_scatter_base) go through its Communicator (its
stats count them; on the CPU it runs them on its torch.distributed fallback,
so the results are gloo's bit for bit), anything tpcomm declines runs
torch's own call (stats unchanged), uninstalling restores ProcessGroup's
own methods, and a model compiled while installed is still traced into
functional collectives (Dynamo keeps recognising dist.all_reduce), which
tpcomm.compile_backend then rewrites."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import traceable_collective_remaps

import tpcomm
from bitexact import exact_values, expected_sum
from multiproc import run_ranks

# What dist's functions call: torch 2.15 gathers and scatters through the
# *_single methods, older torch through the *_base ones.
_METHODS = tuple(m for m in ("allreduce", "_allgather_base", "all_gather_single", "_reduce_scatter_base",
                             "reduce_scatter_single") if m in dist.ProcessGroup.__dict__)


def _calls(comm):
    return {key: s["calls"] for key, s in comm.stats().items()}


def _torch_methods():
    return {name: dist.ProcessGroup.__dict__[name] for name in _METHODS}


def _body_taken(rank, world_size):
    originals = _torch_methods()
    dist_functions = (dist.all_reduce, dist.all_gather_into_tensor, dist.reduce_scatter_tensor)
    comm = tpcomm.Communicator(device="cpu")
    x = exact_values(rank, (4, 8), torch.float32, seed=1)
    total = expected_sum(world_size, (4, 8), torch.float32, seed=1)
    with tpcomm.install() as handle:
        assert handle.installed and (dist.all_reduce, dist.all_gather_into_tensor, dist.reduce_scatter_tensor) \
            == dist_functions and all(f in traceable_collective_remaps for f in dist_functions)
        y = x.clone()
        assert dist.all_reduce(y) is None
        assert torch.equal(y, total)
        gathered = torch.empty(world_size * 4, 8)
        dist.all_gather_into_tensor(gathered, x)
        assert torch.equal(gathered, torch.cat([exact_values(r, (4, 8), torch.float32, seed=1)
                                                for r in range(world_size)]))
        part = torch.empty(2, 8)
        dist.reduce_scatter_tensor(part, x)
        assert torch.equal(part, total.chunk(world_size)[rank])
        legacy = torch.empty(world_size * 4, 8)
        dist._all_gather_base(legacy, x)
        assert torch.equal(legacy, gathered)
        opts = dist.AllreduceOptions()
        assert opts.asyncOp  # the method's default: async, which tpcomm leaves to torch
        dist.group.WORLD.allreduce([y.clone()], opts).wait()
        opts.asyncOp = False
        z = x.clone()
        work = dist.group.WORLD.allreduce([z], opts)  # the method itself, as dist.all_reduce calls it
        assert work.wait() and work.is_completed() and work.result() == [z] and torch.equal(z, total)
        assert _calls(comm) == {("all_reduce", "gloo"): 2, ("all_gather", "gloo"): 2, ("reduce_scatter", "gloo"): 1}, \
            _calls(comm)
    assert not handle.installed and _torch_methods() == originals
    y = x.clone()
    dist.all_reduce(y)  # torch's own again
    assert torch.equal(y, total) and _calls(comm)[("all_reduce", "gloo")] == 2
    comm.close()


def test_installed_group_collectives_run_on_tpcomm():
    run_ranks(2, _body_taken)


def _body_declined(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    other = dist.new_group([0, 1])  # no Communicator, not installed
    x = exact_values(rank, (4, 8), torch.float32, seed=2)
    total = expected_sum(world_size, (4, 8), torch.float32, seed=2)
    handle = tpcomm.install(dist.group.WORLD)
    try:
        y = x.clone()
        dist.all_reduce(y, async_op=True).wait()
        assert torch.equal(y, total)
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        assert torch.equal(y, torch.maximum(exact_values(0, (4, 8), torch.float32, seed=2),
                                            exact_values(1, (4, 8), torch.float32, seed=2)))
        y = x.clone()
        dist.all_reduce(y, group=other)
        assert torch.equal(y, total)
        parts = [torch.empty(4, 8) for _ in range(world_size)]
        dist.all_gather(parts, x)  # the list form: not one of the three
        gathered = torch.empty(world_size * 4, 8)
        dist.all_gather_into_tensor(gathered, x, async_op=True).wait()
        assert torch.equal(gathered, torch.cat(parts))
        assert _calls(comm) == {}, "tpcomm took a call it should have left to torch"
        with pytest.raises(RuntimeError, match="already installed"):
            tpcomm.install()
        with pytest.raises(RuntimeError, match="no open tpcomm.Communicator"):
            tpcomm.install(other)
        comm.close()  # installed, but no open Communicator: torch's path
        y = x.clone()
        dist.all_reduce(y)
        assert torch.equal(y, total)
    finally:
        handle.uninstall()
    handle.uninstall()  # a second time: nothing to do


def test_declined_calls_run_torch():
    run_ranks(2, _body_declined)


def _body_two_groups(rank, world_size):
    originals = _torch_methods()
    comm = tpcomm.Communicator(device="cpu")
    sub = dist.new_group([0, 1])
    sub_comm = tpcomm.Communicator(sub, device="cpu")
    x = exact_values(rank, (4, 8), torch.float32, seed=3)
    total = expected_sum(world_size, (4, 8), torch.float32, seed=3)
    first, second = tpcomm.install(), tpcomm.install(sub)
    first.uninstall()
    y = x.clone()
    dist.all_reduce(y, group=sub)
    dist.all_reduce(x.clone())
    assert torch.equal(y, total)
    assert _calls(sub_comm) == {("all_reduce", "gloo"): 1} and _calls(comm) == {}
    assert _torch_methods() != originals  # still installed for sub
    second.uninstall()
    assert _torch_methods() == originals
    sub_comm.close()
    comm.close()


def test_groups_install_and_uninstall_independently():
    run_ranks(2, _body_two_groups)


def _step(x):
    y = x * 2
    dist.all_reduce(y)
    return y + 1


def _body_compiled_while_installed(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    x = exact_values(rank, (4, 8), torch.float32, seed=4)
    expected = expected_sum(world_size, (4, 8), torch.float32, seed=4) * 2 + 1
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with tpcomm.install():
        torch._dynamo.reset()
        assert torch.equal(torch.compile(_step, backend=keep, fullgraph=True)(x), expected)
        traced = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
        assert "_c10d_functional.all_reduce" in traced and "_c10d_functional.wait_tensor" in traced, traced
        # the graph runs the functional collective itself: installed, it too reaches tpcomm
        # (tpcomm.functional_collectives)
        assert _calls(comm) == {("all_reduce", "gloo"): 1}, _calls(comm)
        torch._dynamo.reset()
        backend = tpcomm.compile_backend("eager")
        assert torch.equal(torch.compile(_step, backend=backend, fullgraph=True)(x), expected)
        assert backend.counts["all_reduce"] == 1 and _calls(comm) == {("all_reduce", "gloo"): 2}
        assert torch.equal(_step(x), expected)  # eager, installed
        assert _calls(comm) == {("all_reduce", "gloo"): 3}
    comm.close()


def test_compiling_while_installed_still_sees_torch_collectives():
    run_ranks(2, _body_compiled_while_installed, timeout=120)


def test_install_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("this process has a process group")
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialised"):
        tpcomm.install()
