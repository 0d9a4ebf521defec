"""tpcomm.unfused_report: an all-reduce left unfused next to an add +
RMSNorm is reported once on the "tpcomm" logger, with why. On small graphs:
an all-reduce whose sum (or its add) ends the graph is a graph break, one
followed by an add and a norm the fusion left is a pattern not matched, one
feeding only a norm or a matmul is nothing. Compiled on 2 gloo ranks: a
module with backward hooks inside the attention-like block breaks the graph
between the all-reduce and its add + norm (transformers 5.3 to 5.21), which
is reported naming the hooks and gone after
tpcomm.skip_backward_hooks_without_grad (fused, nothing reported); a norm
whose weight is fp32 under bf16 activations is reported as not matched."""
import logging

import torch
import torch.distributed as dist

import tpcomm
from tpcomm import unfused_report
from hf_families import Warnings
from multiproc import run_ranks

W = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))


def _norm(h, weight):
    h32 = h.to(torch.float32)
    return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


def _ends_with_sum(x):
    return torch.ops.tpcomm.custom_all_reduce(x * 2, "g")


def _ends_with_add(x, r):
    return r + torch.ops.tpcomm.custom_all_reduce(x, "g").view(x.shape)


def _unmatched(x, r, w):
    z = r + torch.ops.tpcomm.custom_all_reduce(x, "g")
    return _norm(z, w), z


def _unmatched_layer_norm(x, r, w):
    z = r + torch.ops.tpcomm.custom_all_reduce(x, "g") * 0.5
    return torch.nn.functional.layer_norm(z, (8,), w, None, 1e-5), z


def _embedding_like(x, w):
    return torch.nn.functional.linear(_norm(torch.ops.tpcomm.custom_all_reduce(x, "g"), w), W)


def _before_a_matmul(x, r):
    return r + torch.nn.functional.linear(torch.ops.tpcomm.custom_all_reduce(x, "g"), W)


def test_kinds_on_graphs():
    for fn, want in ((_ends_with_sum, "graph break"), (_ends_with_add, "graph break"),
                     (_unmatched, "pattern not matched"), (_unmatched_layer_norm, "pattern not matched"),
                     (_embedding_like, None), (_before_a_matmul, None)):
        found = unfused_report.kinds(torch.fx.symbolic_trace(fn).graph)
        assert found == {k: int(k == want) for k in ("graph break", "pattern not matched")}, (fn.__name__, found)


def test_each_kind_is_said_once(caplog, monkeypatch):
    monkeypatch.setattr(unfused_report, "_said", set())
    breaks = torch._dynamo.utils.counters["graph_break"]
    monkeypatch.setitem(torch._dynamo.utils.counters, "graph_break", type(breaks)())
    torch._dynamo.utils.counters["graph_break"]["Module-level backwards hooks require compiled autograd.\n  more"] += 1
    with caplog.at_level(logging.WARNING, logger="tpcomm"):
        for _ in range(2):
            unfused_report.report(torch.fx.symbolic_trace(_ends_with_add).graph)
            unfused_report.report(torch.fx.symbolic_trace(_unmatched).graph)
    said = [r.getMessage() for r in caplog.records if r.name == "tpcomm"]
    assert len(said) == 2, said
    assert "graph break" in said[0] and "Module-level backwards hooks require compiled autograd." in said[0] \
        and "tpcomm.skip_backward_hooks_without_grad(model)" in said[0] and "more" not in said[0]
    assert "pattern not matched" in said[1]


def test_a_sum_the_graph_returns_without_a_break_is_not_said(caplog, monkeypatch):
    """An all-reduce ending a graph Dynamo did not break (an LM head's) is the model's output: no warning."""
    monkeypatch.setattr(unfused_report, "_said", set())
    breaks = torch._dynamo.utils.counters["graph_break"]
    monkeypatch.setitem(torch._dynamo.utils.counters, "graph_break", type(breaks)())
    with caplog.at_level(logging.WARNING, logger="tpcomm"):
        found = unfused_report.report(torch.fx.symbolic_trace(_ends_with_sum).graph)
    assert found["graph break"] == 1
    assert not [r for r in caplog.records if r.name == "tpcomm"]


class _Hooked(torch.nn.Module):
    """A norm holding a full backward hook (transformers 5.3 to 5.21's q_norm)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))
        self.register_full_backward_hook(lambda module, grad_input, grad_output: None)

    def forward(self, x):
        return _norm(x, self.weight)


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_norm = _Hooked()

    def forward(self, x):
        y = torch.nn.functional.linear(self.q_norm(x), W.to(x.dtype))
        dist.all_reduce(y)  # the row-parallel all-reduce, as transformers 5.x issues it at inference
        return y


class _Layer(torch.nn.Module):
    """The attention, then the residual add and the next norm (of weight_dtype)."""

    def __init__(self, weight_dtype):
        super().__init__()
        self.attn = _Attention()
        self.norm_weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8).to(weight_dtype))

    def forward(self, x, residual):
        z = residual + self.attn(x)
        return _norm(z, self.norm_weight), z


def _compiled(layer, x, residual):
    """(the fused calls the pass counted, the warnings tpcomm logged) of one
    compile and call under no_grad, in a process that has reported nothing."""
    torch._dynamo.reset()
    unfused_report._said.clear()
    warnings = Warnings()
    logging.getLogger("tpcomm").addHandler(warnings)
    backend = tpcomm.compile_backend("aot_eager")
    try:
        with torch.no_grad():
            torch.compile(layer, backend=backend)(x, residual)
    finally:
        logging.getLogger("tpcomm").removeHandler(warnings)
    return backend.counts["all_reduce_add_rms_norm"], warnings.messages


def _body(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    layer = _Layer(torch.float32)
    fused, said = _compiled(layer, x, residual)
    assert fused == 0 and len(said) == 1 and "graph break" in said[0] and "backwards hooks" in said[0], said
    tpcomm.skip_backward_hooks_without_grad(layer)
    assert _compiled(layer, x, residual) == (1, [])

    layer.to(torch.bfloat16)
    assert _compiled(layer, x.bfloat16(), residual.bfloat16()) == (1, []), "bf16 throughout fuses"
    layer.norm_weight.data = layer.norm_weight.data.float()  # an fp32 weight under bf16 activations
    fused, said = _compiled(layer, x.bfloat16(), residual.bfloat16())
    assert fused == 0 and len(said) == 1 and "pattern not matched" in said[0], said
    comm.close()


def test_compiled_models_report_why():
    run_ranks(2, _body, timeout=600)
