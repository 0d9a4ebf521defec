"""What tpcomm puts into torch.compile's cache keys: the world size of every
group a graph's tpcomm ops name, whichever namespace the op is in and however
it names the group (compile_pass.world_tag), and a fingerprint of tpcomm's
version, the pass's sources and every tpcomm op's schema
(tpcomm._cache_key), which compile_backend adds while it compiles and
TpcommPass.uuid holds. On 2 gloo ranks with inductor and a cache directory
of the test's own: the same model compiles from the cache, and after the
version or an op schema changes it compiles afresh, with the model's values."""
import os
import types

import torch

import tpcomm
from tpcomm import _cache_key, _registry, _version, compile_pass
from tpcomm.ops import NAMESPACES

from multiproc import run_ranks


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
        assert compile_pass.cache_tag(norm) == f";tpcomm@{_cache_key.fingerprint()};tpcomm:cache-a=3"
    finally:
        for stub in stubs:
            _registry.unregister(stub)


def test_fingerprint_follows_version_sources_and_schemas(monkeypatch):
    before = _cache_key.fingerprint()
    schemas = _cache_key.op_schemas()
    assert "tpcomm::custom_all_reduce(Tensor x, str group_name) -> Tensor" in schemas
    assert {s.split("::", 1)[0] for s in schemas} == set(NAMESPACES)  # the C++ binding's ops included

    from tpcomm.inductor_pass import TpcommPass

    uuid = TpcommPass().uuid()
    monkeypatch.setattr(_version, "__version__", "0.0.0+another")
    assert _cache_key.fingerprint() != before and TpcommPass().uuid() != uuid
    monkeypatch.undo()
    assert _cache_key.fingerprint() == before and TpcommPass().uuid() == uuid

    library = torch.library.Library("_tpcomm", "FRAGMENT")
    library.define("cache_key_probe(Tensor x) -> Tensor")
    try:
        assert _cache_key.fingerprint() != before
    finally:
        library._destroy()
    assert _cache_key.fingerprint() == before

    here = os.path.dirname(os.path.abspath(_cache_key.__file__))
    assert all(os.path.isfile(os.path.join(here, name)) for name in _cache_key.GRAPH_SOURCES)
    monkeypatch.setattr(_cache_key, "GRAPH_SOURCES", _cache_key.GRAPH_SOURCES[1:])
    _cache_key._sources_digest.cache_clear()
    try:
        assert _cache_key.fingerprint() != before
    finally:
        monkeypatch.undo()
        _cache_key._sources_digest.cache_clear()


class _Layer(torch.nn.Module):
    def __init__(self, group, weight):
        super().__init__()
        self.group, self.weight = group, torch.nn.Parameter(weight)

    def forward(self, y, residual):
        h = residual + torch.ops.tpcomm.custom_all_reduce(y * 2.0, self.group)
        return torch.nn.functional.rms_norm(h, (h.shape[-1],), self.weight, 1e-6), h


class _SandwichOnly(torch.nn.Module):
    """residual + rms_norm(all_reduce(y)): fused, the graph's only tpcomm op is _tpcomm.all_reduce_norm."""

    def __init__(self, group, weight):
        super().__init__()
        self.group, self.weight = group, torch.nn.Parameter(weight)

    def forward(self, y, residual):
        s = torch.ops.tpcomm.custom_all_reduce(y, self.group)
        return residual + torch.nn.functional.rms_norm(s, (s.shape[-1],), self.weight, 1e-6)


def _compiled_from_cache(model, *args):
    """model compiled afresh by Dynamo, inductor after tpcomm's pass: (its
    values, whether inductor's or AOTAutograd's cache served the graph)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        out = torch.compile(model, backend=tpcomm.compile_backend(), fullgraph=True)(*args)
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    misses = counters["inductor"]["fxgraph_cache_miss"]
    assert hits or misses, dict(counters)  # the caches took part
    return out, hits > 0


def _body_cache(rank, world_size, cache_dir):
    # a directory of this test's own, one per rank (the ranks' graphs are the same), empty at first;
    # inductor reads the variable whenever it opens its cache
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    comm = tpcomm.Communicator(device="cpu")
    g = torch.Generator().manual_seed(4)
    weight, residual = torch.rand(64, generator=g) + 0.5, torch.randn(3, 64, generator=g)
    y = torch.randint(-64, 65, (3, 64), generator=torch.Generator().manual_seed(rank)) / 8

    # the fused sandwich's graph holds only the private op: the group's size is still in the key
    tags = []

    def keep(gm, example_inputs):
        tags.append(torch.compiler.config.cache_key_tag)
        return gm.forward

    torch._dynamo.reset()
    backend = tpcomm.compile_backend(keep)
    with torch.no_grad():
        torch.compile(_SandwichOnly(comm.group_name, weight), backend=backend, fullgraph=True)(y, residual)
    assert backend.counts["all_reduce_rms_norm_add"] == 1, backend.counts
    assert tags == [f";tpcomm@{_cache_key.fingerprint()};tpcomm:{comm.group_name}={world_size}"], tags

    model = _Layer(comm.group_name, weight)
    with torch.no_grad():
        eager = model(y, residual)
    first, hit = _compiled_from_cache(model, y, residual)
    assert not hit, "the cache directory was not empty"
    again, hit = _compiled_from_cache(model, y, residual)
    assert hit, "the same graph under the same tpcomm must come from the cache"
    _version.__version__ = "0.0.0+another"
    upgraded, hit = _compiled_from_cache(model, y, residual)
    assert not hit, "a graph compiled under another tpcomm version was served"
    library = torch.library.Library("_tpcomm", "FRAGMENT")
    library.define("cache_key_probe(Tensor x) -> Tensor")
    reschemed, hit = _compiled_from_cache(model, y, residual)
    assert not hit, "a graph compiled against other op schemas was served"
    for out in (first, again, upgraded, reschemed):
        assert torch.equal(out[1], eager[1])
        torch.testing.assert_close(out[0], eager[0], rtol=2e-6, atol=2e-6)
    comm.close()


def test_cache_is_not_served_across_versions_or_schemas(tmp_path):
    run_ranks(2, _body_cache, str(tmp_path), timeout=600)
