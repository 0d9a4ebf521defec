"""What tpcomm puts into torch.compile's cache keys: the world size of every
group a graph's tpcomm ops name, whichever namespace the op is in and however
it names the group (compile_pass.world_tag)."""
import types

import torch

from tpcomm import _registry, compile_pass


def _graph(target, args, kwargs=None):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(target, tuple(x if a == "x" else a for a in args), kwargs or {}))
    return graph


def test_world_tag_names_every_namespace_and_spelling():
    """A graph whose only tpcomm op is the private _tpcomm.all_reduce_norm
    (all the fusion leaves of a sandwich norm), a public op called as the
    packet Dynamo records with group_name by keyword, an internal op taking
    a communicator id: each group's world size is in the tag."""
    stubs = [types.SimpleNamespace(group_name="cache-a", comm_id=0, world_size=3),
             types.SimpleNamespace(group_name="cache-b", comm_id=0, world_size=5),
             types.SimpleNamespace(group_name="cache-c", comm_id=77, world_size=4)]
    for stub in stubs:
        _registry.register(stub)
    try:
        norm = _graph(torch.ops._tpcomm.all_reduce_norm.default, ("x", "x", "x", None, 1e-6, 1e-6, 1.0, 1, "cache-a"))
        assert compile_pass.world_tag(norm) == ";tpcomm:cache-a=3"
        gather = _graph(torch.ops.tpcomm.custom_all_gather, ("x", 0), {"group_name": "cache-b"})
        assert compile_pass.world_tag(gather) == ";tpcomm:cache-b=5"
        by_id = _graph(torch.ops._tpcomm.all_reduce.default, ("x", 77, 0))
        assert compile_pass.world_tag(by_id) == ";tpcomm:cache-c=4"
        unknown = _graph(torch.ops.tpcomm.custom_all_reduce.default, ("x", "no-such-group"))
        assert compile_pass.world_tag(unknown) == ""
    finally:
        for stub in stubs:
            _registry.unregister(stub)
