"""The compile pass fuses the norms and residual forms model code writes
beyond Llama's RMSNorm (tpcomm.dynamo_norms), on 2 gloo ranks under
tpcomm.compile_backend("aot_eager"): LayerNorm (nn.LayerNorm with and
without bias, F.layer_norm without weight, OLMo's fp32 F.layer_norm, Cohere's
written-out LayerNorm) before the add, after it and on both sides; the
residual multiplier (residual + s * m, before or after a norm); RMSNorm with
the weight multiplied before the cast back. Each fuses once under its
pattern's key, stats() counts one fused call and no all-reduce, and the
values are eager torch's within the few fp32 ulp of rounding once.
What must be left alone is (an intermediate with a second user, a norm on
another dtype, a multiplier tensor of more than one element): nothing
fuses, compile succeeds and the values are eager torch's bit for bit."""
import torch

import tpcomm
from tpcomm.norm_patterns import STATS_KEY, Pattern

from fusion_form_models import EPS, HIDDEN, Post, Pre, any_norm, fused_cases
from multiproc import run_ranks

def _compiled(model, *args, dynamic=None):
    """(compiled model's outputs, eager's, the pass's counts). Under dynamic=True the inner backend
    runs the graph the pass rewrote as it is (aot_eager would restart the frame with the symbolic
    float a constant, as inductor does: tpcomm.fusion's doc), and its fused call must take the
    multiplier as the .item() Dynamo reads."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    backend = tpcomm.compile_backend(keep if dynamic else "aot_eager")
    with torch.no_grad():
        got = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
        eager = model(*args)
    if dynamic:
        (gm,) = graphs
        (call,) = [n for n in gm.graph.nodes if n.target is torch.ops._tpcomm.all_reduce_norm.default]
        scale = call.kwargs["residual_scale"]
        assert isinstance(scale, torch.fx.Node) and scale.target == "item", call
    return got, eager, backend.counts


def _inputs(rank):
    g = torch.Generator().manual_seed(5)
    w, b = torch.rand(HIDDEN, generator=g) + 0.5, torch.rand(HIDDEN, generator=g) - 0.5
    residual = torch.randn(6, HIDDEN, generator=g)
    y = torch.randint(-64, 65, (6, HIDDEN), generator=torch.Generator().manual_seed(rank)) / 8
    return w, b, residual, y


def _body_fused(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    w, b, residual, y = _inputs(rank)
    for model, key, dynamic in fused_cases(comm.group_name, w, b):
        what = f"{type(model).__name__} {model.kind} m={model.m} dynamic={dynamic}"
        before = comm.stats()
        got, eager, counts = _compiled(model, y, residual, dynamic=dynamic)
        fused = {k: n for k, n in counts.items() if n and k not in ("all_reduce",)}
        assert fused == {key: 1}, (what, counts)
        calls = {}
        for (op, how), v in comm.stats().items():
            calls[op] = calls.get(op, 0) + v["calls"] - before.get((op, how), {"calls": 0})["calls"]
        # compiled: one fused call; eager: one all-reduce
        assert {k: n for k, n in calls.items() if n} == {key: 1, "all_reduce": 1}, (what, calls)
        for i, (g, e) in enumerate(zip(got, eager)):  # the fused op rounds once from fp32: a few ulp
            torch.testing.assert_close(g, e, rtol=4e-6, atol=4e-6, msg=f"{what}: output {i}")
    comm.close()


def test_each_form_fuses_once_with_eagers_values():
    run_ranks(2, _body_fused, timeout=600)


class KeepsScaled(Pre):
    """The scaled sum s * m is also returned: a second user of an intermediate."""

    def forward(self, y, residual):
        t = torch.ops.tpcomm.custom_all_reduce(y, self.group) * self.m
        h = residual + t
        return any_norm(self.kind, h, self.w, self.b), h, t


class KeepsCentred(Pre):
    """Cohere's LayerNorm whose centred input is also returned."""

    def forward(self, y, residual):
        h = residual + torch.ops.tpcomm.custom_all_reduce(y, self.group)
        f = h.to(torch.float32)
        c = f - f.mean(-1, keepdim=True)
        n = (self.w.to(torch.float32) * (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + EPS))).to(h.dtype)
        return n, h, c


class OtherDtype(Pre):
    """A LayerNorm on z.float() of a bf16 model, never cast back: its output is fp32, the fused op's bf16."""

    def forward(self, y, residual):
        h = residual + torch.ops.tpcomm.custom_all_reduce(y, self.group)
        return torch.nn.functional.layer_norm(h.float(), (HIDDEN,), self.w.float(), self.b.float(), EPS), h


def _body_left_alone(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    w, b, residual, y = _inputs(rank)
    group = comm.group_name
    vector = torch.linspace(0.5, 1.5, HIDDEN)
    models = [(KeepsScaled(group, "module", w, b, m=0.5), (y, residual)),
              (KeepsCentred(group, "cohere", w, b), (y, residual)),
              (OtherDtype(group, "module", w.bfloat16(), b.bfloat16()), (y.bfloat16(), residual.bfloat16())),
              (Pre(group, "module", w, b, m=vector), (y, residual)),         # a multiplier of HIDDEN elements
              (Post(group, "weight_first", w, b, m=vector), (y, residual))]
    for model, args in models:
        what = f"{type(model).__name__} {model.kind}"
        got, eager, counts = _compiled(model, *args)
        assert not any(counts[k] for k in STATS_KEY.values()), (what, counts)
        for i, (g, e) in enumerate(zip(got, eager)):
            assert torch.equal(g, e), f"{what}: output {i}"
    assert set(comm.stats()) == {("all_reduce", "gloo")}, comm.stats()
    comm.close()


def test_what_the_pass_must_leave_alone_compiles_unfused():
    run_ranks(2, _body_left_alone, timeout=600)


def _body_graph(rank, world_size):
    from norm_helpers import capture
    from tpcomm import fusion

    comm = tpcomm.Communicator(device="cpu")
    w, b, residual, y = _inputs(rank)
    for form in ("module", "cohere", "weight_first"):
        gm, _ = capture(Pre(comm.group_name, form, w, b, m=0.25), y, residual)
        pattern = Pattern.ADD_NORM if form == "weight_first" else Pattern.ADD_LAYER_NORM
        assert {k: n for k, n in fusion.fuse(gm).items() if n} == {STATS_KEY[pattern]: 1}, form
        (call,) = [n for n in gm.graph.nodes if n.op == "call_function"
                   and n.target is torch.ops._tpcomm.all_reduce_norm.default]
        assert call.args[7] == int(pattern) and call.kwargs["residual_scale"] == 0.25, (form, call)
        assert ("bias" in call.kwargs) == (form == "module"), (form, call)
    comm.close()


def test_the_rewrite_passes_bias_and_scale_only_where_given():
    """The fused call's arguments in the rewritten graph: the pattern, the multiplier as residual_scale,
    a bias only where the norm has one."""
    run_ranks(1, _body_graph)
