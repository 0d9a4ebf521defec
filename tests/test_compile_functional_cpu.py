"""tpcomm.compile_backend over torch's own collectives, on 2 gloo ranks (the
Communicator takes its torch.distributed fallback on the CPU, so every
result is gloo's, bit for bit): dist.all_reduce / all_gather_into_tensor /
reduce_scatter_tensor and the functional collectives become tpcomm's ops on
a group with an open Communicator (the graph after the pass holds no
functional collective, the stats count each call); the copy Dynamo writes
for dist.all_reduce goes, so the add + RMSNorm fuses; other groups, other
reduce ops, async uses, graph inputs and views are left alone; the inductor
pass object does the same on the graph AOT autograd makes (what
inductor's post-grad passes get; inductor itself runs in the GPU test)."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import tpcomm
from tpcomm import _cache_key
from tpcomm.graph_pass import COUNTED
from bitexact import exact_values, expected_sum
from multiproc import run_ranks

_F = torch.ops._c10d_functional


def _targets_of(node):
    """A call_function node's op name, or None."""
    if node.op == "call_function" and hasattr(node.target, "name"):
        return node.target.name().split(".")[0]
    return None


def _targets(gm):
    """call_function targets of gm's graph, by their op's name."""
    return [name for name in map(_targets_of, gm.graph.nodes) if name]


tags = []  # torch.compiler.config.cache_key_tag as each graph was compiled


def _compile(fn, *args, fuse=True, dynamic=False):
    """fn compiled (fullgraph) with tpcomm's backend whose inner backend
    keeps the graph it receives (and the cache-key tag in `tags`); (result
    of the second call, the graph, the pass's counts)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        tags.append(torch.compiler.config.cache_key_tag)
        return gm.forward

    torch._dynamo.reset()
    backend = tpcomm.compile_backend(keep, fuse=fuse)
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
    fresh = lambda: [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # noqa: E731
    compiled(*fresh())
    out = compiled(*fresh())
    assert len(graphs) == 1, f"{len(graphs)} graphs: the function broke"
    return out, graphs[0], backend.counts


def _torch_collectives(x, group):
    y = x * 2
    dist.all_reduce(y, group=group)                                 # in place
    z = funcol.all_reduce(x + 1, "sum", group)                      # functional
    gathered = torch.empty((2 * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(gathered, y + z, group=group)
    part = torch.empty_like(x)
    dist.reduce_scatter_tensor(part, gathered, group=group)
    g2 = funcol.all_gather_tensor(part, 0, group)
    r2 = funcol.reduce_scatter_tensor(g2, "sum", 0, group)
    return y, z, gathered, part, r2


def _body_rewrites(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    x = exact_values(rank, (4, 8), torch.float32, seed=3)
    expected = _torch_collectives(x, dist.group.WORLD)
    got, gm, counts = _compile(_torch_collectives, x, dist.group.WORLD)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"output {i}"
    assert counts == {**dict.fromkeys(COUNTED, 0), "all_reduce": 2, "all_gather": 2, "reduce_scatter": 2}
    # the group's size is in the key of torch's compile caches while the graph compiles, and only then
    assert tags[-1] == f";tpcomm@{_cache_key.fingerprint()};tpcomm:{comm.group_name}=2", tags
    assert torch.compiler.config.cache_key_tag == ""
    targets = _targets(gm)
    assert not [t for t in targets if t.startswith("_c10d_functional::")], targets
    assert targets.count("tpcomm::custom_all_reduce") == 2 and targets.count("tpcomm::custom_all_gather") == 2 \
        and targets.count("tpcomm::custom_reduce_scatter") == 2, targets
    # the copies into y, gathered and part (fresh tensors) are gone
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "copy_"]
    stats = comm.stats()  # both compiled calls (the eager reference ran torch's own collectives)
    assert stats[("all_reduce", "gloo")]["calls"] == 2 * 2
    assert stats[("all_gather", "gloo")]["calls"] == 2 * 2 and stats[("reduce_scatter", "gloo")]["calls"] == 2 * 2
    comm.close()


def test_torch_collectives_become_tpcomm_ops():
    run_ranks(2, _body_rewrites, timeout=180)


def _left_alone(x, other, group, name):
    a = funcol.all_reduce(x, "max", group)                            # another reduce op
    b = funcol.all_reduce(x, "sum", other)                            # a group with no Communicator
    pending = _F.all_reduce(x * 3, "sum", name)                       # async: work before the wait
    c = x.sin()
    d = _F.wait_tensor(pending)
    e = funcol.all_reduce(x + 2, "sum", group)                        # the one this pass takes
    return a, b, c, d, e


def _body_left_alone(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    other = dist.new_group([0, 1])  # the same ranks, another group name, no Communicator
    assert other.group_name != comm.group_name
    x = exact_values(rank, (4, 8), torch.float32, seed=4)
    expected = _left_alone(x, other, dist.group.WORLD, comm.group_name)
    got, gm, counts = _compile(_left_alone, x, other, dist.group.WORLD, comm.group_name)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"output {i}"
    assert counts["all_reduce"] == 1, counts
    kept = [(n.args[1], n.args[2]) for n in gm.graph.nodes if n.op == "call_function" and n.target in
            (_F.all_reduce, _F.all_reduce.default)]
    assert sorted(kept) == sorted([("max", comm.group_name), ("sum", other.group_name), ("sum", comm.group_name)])
    comm.close()


def test_other_groups_ops_and_async_uses_are_left_alone():
    run_ranks(2, _body_left_alone, timeout=180)


class _Layer(torch.nn.Module):
    """A row-parallel output reduced with dist.all_reduce in place (as
    transformers does), the residual add and an RMSNorm: torch.nn.RMSNorm,
    or Llama's spelling."""

    def __init__(self, hidden, llama_style):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.w = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden ** 0.5)
        self.norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=g))
        self.llama_style = llama_style
        self.eps = 1e-5  # an attribute, as models keep it: a tensor read by .item() under dynamic=True

    def norm(self, h):
        if not self.llama_style:
            return torch.nn.functional.rms_norm(h, (h.shape[-1],), self.norm_weight, self.eps)
        h32 = h.to(torch.float32)
        h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight * h32.to(h.dtype)

    def forward(self, x, residual):
        y = torch.nn.functional.linear(x, self.w)
        dist.all_reduce(y)
        h = residual + y
        return self.norm(h), h


def _input_reduced(x, residual):
    dist.all_reduce(x)  # x is the graph's input: the caller sees it changed
    return residual + x


def _view_reduced(x):
    big = x * 2
    y = big[:2]
    dist.all_reduce(y)  # a (contiguous) view: big changes with it
    return big + 1


def _body_fusion(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    x = exact_values(rank, (4, 8), torch.float32, seed=5)
    residual = exact_values(0, (4, 8), torch.float32, seed=6)
    for llama_style, dynamic in ((False, False), (True, False), (False, True), (True, True)):
        layer = _Layer(8, llama_style)
        with torch.no_grad():
            expected = layer(x, residual)
            got, gm, counts = _compile(layer, x, residual, dynamic=dynamic)
            unfused, _, unfused_counts = _compile(layer, x, residual, fuse=False, dynamic=dynamic)
        assert counts == {**dict.fromkeys(COUNTED, 0), "all_reduce": 1, "all_gather": 0, "reduce_scatter": 0,
                          "all_reduce_add_rms_norm": 1}, \
            (llama_style, dynamic)
        assert unfused_counts["all_reduce_add_rms_norm"] == 0
        assert "tpcomm::custom_all_reduce_add_rms_norm" in _targets(gm)
        eps = next(n for n in gm.graph.nodes if _targets_of(n) == "tpcomm::custom_all_reduce_add_rms_norm").args[3]
        # a constant, or under dynamic=True the .item() of the tensor Dynamo passes the attribute as
        assert eps == 1e-5 if not dynamic else (isinstance(eps, torch.fx.Node) and eps.target == "item")
        for a, b in zip(unfused, expected):
            assert torch.equal(a, b), "the collective alone changed the model's arithmetic"
        # fused: the sum and the residual add are the model's (exact here), the norm in another order
        assert torch.equal(got[1], expected[1])
        torch.testing.assert_close(got[0], expected[0], rtol=1.3e-6, atol=1e-5)

    expected = _input_reduced(x.clone(), residual)
    got, gm, counts = _compile(_input_reduced, x, residual)
    assert counts["all_reduce"] == 1 and torch.equal(got, expected)
    assert [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "copy_"], \
        "the copy into the graph's input must stay"
    x_in = x.clone()
    _input_reduced(x_in, residual)
    torch._dynamo.reset()
    compiled = torch.compile(_input_reduced, backend=tpcomm.compile_backend("eager"), fullgraph=True)
    x_c = x.clone()
    compiled(x_c, residual)
    assert torch.equal(x_c, x_in), "the caller's tensor was not reduced in place"

    got, gm, counts = _compile(_view_reduced, x)
    assert counts["all_reduce"] == 1 and torch.equal(got, _view_reduced(x.clone()))
    assert [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "copy_"], \
        "the copy into a view must stay"
    comm.close()


def test_dist_all_reduce_then_add_rms_norm_fuses():
    run_ranks(2, _body_fusion, timeout=240)


def _body_fusion_inductor_dynamic(rank, world_size):
    """Under dynamic=True inductor cannot make a tensor of the symbolic eps
    the fused op takes, so it restarts the frame with eps a constant: the
    graph it then compiles holds the fused op with eps written in."""
    from torch._inductor.compile_fx import compile_fx

    comm = tpcomm.Communicator(device="cpu")
    x = exact_values(rank, (4, 8), torch.float32, seed=5)
    residual = exact_values(0, (4, 8), torch.float32, seed=6)
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    layer = _Layer(8, llama_style=True)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = layer(x, residual)
        got = torch.compile(layer, backend=tpcomm.compile_backend(inductor), fullgraph=True, dynamic=True)(x, residual)
    fused = [n for n in graphs[-1].graph.nodes if _targets_of(n) == "tpcomm::custom_all_reduce_add_rms_norm"]
    assert len(fused) == 1 and fused[0].args[3] == 1e-5, graphs[-1].graph
    assert torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[0], expected[0], rtol=1.3e-6, atol=1e-5)
    assert comm.stats()[("all_reduce_add_rms_norm", "unfused")]["calls"] == 1  # the CPU's path of the fused op
    comm.close()


def test_fusion_under_dynamic_shapes_reaches_inductor():
    run_ranks(2, _body_fusion_inductor_dynamic, timeout=300)


def _body_inductor_pass(rank, world_size):
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from tpcomm.inductor_pass import TpcommPass

    uuid_without = TpcommPass().uuid()
    comm = tpcomm.Communicator(device="cpu")
    tpcomm_pass = TpcommPass()
    assert isinstance(tpcomm_pass, CustomGraphPass) and tpcomm_pass.uuid() != uuid_without

    def fn(x):
        y = x * 2
        dist.all_reduce(y)
        return funcol.all_gather_tensor(y + 1, 0, dist.group.WORLD) * 3

    graphs = []

    def forward_compiler(gm, example_inputs):
        """What inductor's post-grad passes get: AOT's functional aten graph."""
        tpcomm_pass(gm.graph)
        gm.recompile()
        graphs.append(gm)
        return gm

    x = exact_values(rank, (4, 8), torch.float32, seed=8)
    expected = fn(x)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(fn, backend=aot_autograd(fw_compiler=forward_compiler), fullgraph=True)(x)
    assert torch.equal(got, expected)
    assert tpcomm_pass.counts["all_reduce"] == 1 and tpcomm_pass.counts["all_gather"] == 1, tpcomm_pass.counts
    targets = _targets(graphs[0])
    assert "tpcomm::custom_all_reduce" in targets and not [t for t in targets if t.startswith("_c10d_functional")]
    assert comm.stats()[("all_reduce", "gloo")]["calls"] == 1

    # AOT's and inductor's graphs may place allocations, views and casts
    # between a collective and its wait: still a synchronous use.
    # Arithmetic there is an async one.
    aten, name = torch.ops.aten, comm.group_name

    def allocation_between(x):
        y = _F.all_reduce.default(x, "sum", name)
        aten.empty.memory_format([4, 8])
        z = aten.view.default(x, [32])
        return _F.wait_tensor.default(y), z

    def cast_between(x):
        y = _F.all_reduce.default(x, "sum", name)
        z = torch.ops.prims.convert_element_type.default(x, torch.bfloat16)
        w = aten._to_copy.default(x, dtype=torch.float16)
        return _F.wait_tensor.default(y), z, w

    def work_between(x):
        y = _F.all_reduce.default(x, "sum", name)
        z = aten.sin.default(x)
        return _F.wait_tensor.default(y), z

    for fn, taken in ((allocation_between, 1), (cast_between, 1), (work_between, 0)):
        gm = torch.fx.symbolic_trace(fn)
        assert tpcomm.graph_pass.rewrite_collectives(gm.graph)["all_reduce"] == taken, fn.__name__
        gm.recompile()
        assert torch.equal(gm(x)[0], expected_sum(world_size, (4, 8), torch.float32, seed=8)), fn.__name__
    comm.close()


def test_inductor_pass_rewrites_after_aot():
    run_ranks(2, _body_inductor_pass, timeout=180)
