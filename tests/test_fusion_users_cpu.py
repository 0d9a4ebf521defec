"""The fusion leaves alone a pattern whose removed values are read outside
it, on 2 gloo ranks: for every pattern (ADD_NORM, NORM_ADD, NORM_ADD_NORM)
and every spelling of the norm (F.rms_norm, Llama's, Gemma's), each node the
clean rewrite removes is given one more user (an extra graph output). A
value only the pattern's inside holds (the all-reduce's sum, a norm's inner
node or cast) stops that pattern: the graph stays exactly as it was, or a
smaller pattern fuses that leaves the node in place (NORM_ADD, where the
extra user sits inside the next norm). A value the fused op returns (z, o,
the normed output) is read from it. Never an error, and the graph's values
are the unfused graph's. Compiled models that keep such a value compile, give eager
torch's values and count no fused call in stats()."""
import torch

import tpcomm
from tpcomm import fusion
from tpcomm.norm_patterns import STATS_KEY, Pattern

from multiproc import run_ranks
from norm_helpers import capture, copy_graph, norm

HIDDEN = 64


class _PreNorm(torch.nn.Module):
    """ADD_NORM: residual + all_reduce(y) (through a dropout and a reshape), then the next norm."""

    def __init__(self, group, kind, w1, w2=None):
        super().__init__()
        self.group, self.kind, self.w = group, kind, torch.nn.Parameter(w1)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, y, residual):
        h = residual + self.drop(torch.ops.tpcomm.custom_all_reduce(y, self.group).reshape(residual.shape))
        return norm(self.kind, h, self.w), h


class _PostNorm(torch.nn.Module):
    """NORM_ADD (then_norm=False) or NORM_ADD_NORM: residual + norm(all_reduce(y)) [, its next norm]."""

    def __init__(self, group, kind, w1, w2, then_norm=True):
        super().__init__()
        self.group, self.kind, self.then_norm = group, kind, then_norm
        self.w1, self.w2 = torch.nn.Parameter(w1), torch.nn.Parameter(w2)

    def forward(self, y, residual):
        h = residual + norm(self.kind, torch.ops.tpcomm.custom_all_reduce(y, self.group), self.w1)
        return (norm(self.kind, h, self.w2), h) if self.then_norm else (h,)


def _models(group, w1, w2):
    """(model, the key its fused pattern counts under) for every pattern and spelling."""
    out = []
    for kind in ("functional", "llama", "gemma"):
        out.append((_PreNorm(group, kind, w1), STATS_KEY[Pattern.ADD_NORM]))
        out.append((_PostNorm(group, kind, w1, w2, then_norm=False), STATS_KEY[Pattern.NORM_ADD]))
        out.append((_PostNorm(group, kind, w1, w2), STATS_KEY[Pattern.NORM_ADD_NORM]))
    return out


def _names(gm):
    return {n.name for n in gm.graph.nodes}


def _assert_values(got, expected, what, exact):
    assert len(got) == len(expected), what
    for i, (g, e) in enumerate(zip(got, expected)):
        if exact:
            assert torch.equal(g, e), f"{what}: output {i}"
        else:  # the fused op's fp32 norm against the model's: a few ulp
            torch.testing.assert_close(g, e, rtol=4e-6, atol=4e-6, msg=f"{what}: output {i}")


def _body_every_removed_node(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    g = torch.Generator().manual_seed(11)
    w1, w2 = torch.randn(HIDDEN, generator=g), torch.randn(HIDDEN, generator=g)
    residual = torch.randn(6, HIDDEN, generator=g)
    y = torch.randint(-64, 65, (2, 3, HIDDEN), generator=torch.Generator().manual_seed(rank)) / 8
    for model, key in _models(comm.group_name, w1, w2):
        args = (y if isinstance(model, _PreNorm) else y.view(6, HIDDEN), residual)
        gm, inputs = capture(model.eval(), *args)
        clean = copy_graph(gm)
        assert fusion.fuse(clean)[key] == 1, (model.kind, key)
        removed = _names(gm) - _names(clean)
        by_name = {n.name: n for n in gm.graph.nodes}
        assert any(by_name[n].target in fusion._ALL_REDUCE for n in removed)
        for name in sorted(removed):
            what = f"{type(model).__name__} {model.kind} ({key}), one more user of {name}"
            # inside: every user of the node in the clean graph goes with the rewrite
            inside = all(u.name in removed for u in by_name[name].users)
            variant = copy_graph(gm, extra=name)
            with torch.no_grad():
                expected = variant(*inputs)
                code = variant.code
                counts = fusion.fuse(variant)  # never raises, never leaves a half-rewritten graph
                variant.graph.lint()
                got = variant(*inputs)
            if inside:  # the pattern is not fused and the node still computes its value
                assert counts[key] == 0 and name in _names(variant), (what, counts)
                if not any(counts.values()):
                    assert variant.code == code, what
                # else a smaller pattern fused without the node (NORM_ADD, the next norm kept)
            else:
                assert counts[key] == 1 and sum(counts.values()) == 1, (what, counts)
            _assert_values(got, expected, what, exact=not any(counts.values()))
    comm.close()


def test_a_removed_value_read_elsewhere_stops_the_rewrite():
    run_ranks(2, _body_every_removed_node, timeout=600)


class _KeepsSum(_PostNorm):
    """Gemma's sandwich that also returns the all-reduce's sum."""

    def forward(self, y, residual):
        s = torch.ops.tpcomm.custom_all_reduce(y, self.group)
        h = residual + norm(self.kind, s, self.w1)
        return (norm(self.kind, h, self.w2), h, s) if self.then_norm else (h, s)


class _KeepsNormed(_PostNorm):
    """The sandwich that also returns the first norm's output (before the add)."""

    def forward(self, y, residual):
        n = norm(self.kind, torch.ops.tpcomm.custom_all_reduce(y, self.group), self.w1)
        h = residual + n
        return (norm(self.kind, h, self.w2), h, n) if self.then_norm else (h, n)


class _KeepsSquare(_PreNorm):
    """The pre-norm whose norm's mean of squares is also returned."""

    def forward(self, y, residual):
        h = residual + torch.ops.tpcomm.custom_all_reduce(y, self.group)
        f = h.float()
        square = f.pow(2).mean(-1, keepdim=True)
        return self.w * (f * torch.rsqrt(square + 1e-6)).to(h.dtype), h, square


def _body_compiled(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    g = torch.Generator().manual_seed(12)
    w1, w2 = torch.randn(HIDDEN, generator=g), torch.randn(HIDDEN, generator=g)
    residual = torch.randn(6, HIDDEN, generator=g)
    y = torch.randint(-64, 65, (6, HIDDEN), generator=torch.Generator().manual_seed(rank)) / 8
    name = comm.group_name
    models = [_KeepsSum(name, kind, w1, w2, then) for kind in ("functional", "gemma") for then in (False, True)]
    models += [_KeepsNormed(name, "llama", w1, w2, then) for then in (False, True)]
    models += [_KeepsSquare(name, "llama", w1)]
    for model in models:
        torch._dynamo.reset()
        backend = tpcomm.compile_backend("aot_eager")
        with torch.no_grad():
            got = torch.compile(model, backend=backend, fullgraph=True)(y, residual)
            eager = model(y, residual)
        what = f"{type(model).__name__} {model.kind}"
        assert not any(backend.counts[k] for k in STATS_KEY.values()), (what, backend.counts)
        _assert_values(got, eager, what, exact=True)
    # every call the compiled models and eager made: the all-reduce alone, none fused
    assert set(comm.stats()) == {("all_reduce", "gloo")}, comm.stats()
    assert comm.stats()[("all_reduce", "gloo")]["calls"] == 2 * len(models)
    comm.close()


def test_compiled_models_that_keep_an_inner_value():
    run_ranks(2, _body_compiled, timeout=600)

