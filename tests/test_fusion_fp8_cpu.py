"""The compile pass fuses the FP8 quantization of the fused norm's output
(tpcomm.fusion_fp8), on 2 gloo ranks (every call takes the unfused route on
CPU: fp32 from the sum to the norm, rounded once to the dtype, then
tpcomm.fp8.quantize, the numerics of the kernel). For every pattern tpcomm.fusion knows
(ADD_NORM, NORM_ADD, NORM_ADD_NORM), every spelling of the norm (F.rms_norm,
Llama's with weight w, Gemma's with weight 1 + w) and every form of the
quantization fusion_fp8's doc lists, a model of two layers compiled with
tpcomm.compile_backend("aot_eager") holds one _tpcomm.all_reduce_norm_fp8 a
layer and nothing of the quantization, counts them under the pattern's
"_fp8" key, and gives eager torch's codes and scales bit for bit.

The eager side: the same model's quantization code, run by eager torch on
the normed output of torch.ops._tpcomm.all_reduce_norm, run eagerly. Not the
model's own eager norm: the model sums in the dtype (the all-reduce), and
its norm rounds where the fused one does not (Llama's rounds h * rsqrt(...)
before the weight, F.rms_norm likewise), so its normed values differ from
the fused op's in the last bit, as they do without FP8 (tpcomm.fusion's doc),
and a last bit can move a code. Where the model's own norm computes as the
fused one does (fp32, Llama's and Gemma's code), the eager model is compared
directly too."""
import pytest
import torch

import tpcomm
from tpcomm.fusion_fp8 import COUNT_KEY
from tpcomm.norm_patterns import STATS_KEY, Pattern

import fp8_models as M
from multiproc import run_ranks


def _check(model, y, residual, comm, what, layers=2, inner="aot_eager"):
    """Compiles model, checks its graph and counts, returns its outputs after
    checking them against the eager reference."""
    out, backend, gm = M.compile_and_run(model, y, residual, inner=inner)
    graph = M.targets(gm)
    assert graph.count(M.FP8_OP) == layers, (what, graph)
    assert not any(t in M.NORM_OPS for t in graph), (what, graph)
    # nothing of the quantization left: no cast to e4m3, no amax, no clamp
    left = [n for n in gm.graph.nodes if n.op == "call_method" and n.target in ("amax", "abs", "clamp", "to")]
    assert not left, (what, left)
    key = COUNT_KEY[model.pattern]
    assert backend.counts[key] == layers and backend.counts[STATS_KEY[model.pattern]] == 0, (what, backend.counts)
    with torch.no_grad():
        want = model(y, residual, reference=True)
    M.assert_same(out, want, what)
    return out


def _body_patterns(rank, world_size, dtype, quants):
    comm = tpcomm.Communicator(device="cpu")
    w1, w2 = M.weights(dtype)
    y, residual = M.inputs(rank, dtype)
    scale = torch.tensor(1 / 64)
    calls = 0
    for pattern in M.PATTERNS:
        for kind in ("functional", "llama", "gemma"):
            for name in quants:
                model = M.Layers(comm.group_name, pattern, kind, M.QUANTS[name], w1, w2, scale).eval()
                what = f"{pattern.name} {kind} {name} {dtype}"
                out = _check(model, y, residual, comm, what)
                calls += 2
                if dtype == torch.float32 and kind != "functional":
                    with torch.no_grad():  # the model's own norm rounds as the fused one: the same bits
                        M.assert_same(out, model(y, residual), what + " against the eager model")
    stats = comm.stats()  # the compiled models' calls: the FP8 op's, each once (the references: the norm's)
    assert sum(stats[(COUNT_KEY[p], "unfused")]["calls"] for p in M.PATTERNS) == calls, stats
    comm.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_pattern_and_norm_with_each_mode(dtype):
    run_ranks(2, _body_patterns, dtype, M.CORE, timeout=600)


def _body_forms(rank, world_size):
    """Every form of QUANTS on every pattern (Llama's norm, bf16), rows of 2-D and 3-D inputs."""
    comm = tpcomm.Communicator(device="cpu")
    w1, w2 = M.weights(torch.bfloat16)
    scale = torch.tensor([0.015625])  # shape (1,): one element as a 1-D tensor
    for shape in ((6, M.HIDDEN), (2, 3, M.HIDDEN)):
        y, residual = (t.view(shape) for t in M.inputs(rank, torch.bfloat16))
        for pattern in M.PATTERNS:
            for name, quant in M.QUANTS.items():
                model = M.Layers(comm.group_name, pattern, "llama", quant, w1, w2, scale).eval()
                _check(model, y, residual, comm, f"{pattern.name} {name} {shape}")
    comm.close()


def test_every_form_of_the_quantization():
    run_ranks(2, _body_forms, timeout=600)


def _body_keeps_normed(rank, world_size):
    """A model that also returns the normed output (a second user of it): the
    op writes it (return_normed=True) and the graph returns the op's."""
    comm = tpcomm.Communicator(device="cpu")
    w1, w2 = M.weights(torch.bfloat16)
    y, residual = M.inputs(rank, torch.bfloat16)
    for pattern in (Pattern.ADD_NORM, Pattern.NORM_ADD_NORM):
        for name in ("static", "token_vllm", "group"):
            model = M.Layers(comm.group_name, pattern, "gemma", M.QUANTS[name], w1, w2, torch.tensor(0.02),
                             keep_normed=True).eval()
            what = f"{pattern.name} {name} normed kept"
            _, _, gm = M.compile_and_run(model, y, residual)
            calls = [n for n in gm.graph.nodes if n.target is M.FP8_OP]
            assert [n.args[12] for n in calls] == [True, True], (what, calls)
            _check(model, y, residual, comm, what)
    comm.close()


def test_a_normed_output_still_used_is_returned_by_the_op():
    run_ranks(2, _body_keeps_normed, timeout=600)


def _body_inductor(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    w1, w2 = M.weights(torch.bfloat16)
    y, residual = M.inputs(rank, torch.bfloat16)
    for pattern, kind, name in ((Pattern.ADD_NORM, "functional", "token"), (Pattern.NORM_ADD_NORM, "gemma", "group")):
        model = M.Layers(comm.group_name, pattern, kind, M.QUANTS[name], w1, w2, None).eval()
        _check(model, y, residual, comm, f"inductor {pattern.name} {kind} {name}", inner="inductor")
    comm.close()


def test_inductor():
    run_ranks(2, _body_inductor, timeout=600)


def _body_dynamic(rank, world_size):
    """torch.compile(dynamic=True): the rows symbolic (the groups' view back to
    rows then reads f.size(), which goes with the pattern)."""
    comm = tpcomm.Communicator(device="cpu")
    w1, w2 = M.weights(torch.bfloat16)
    y, residual = M.inputs(rank, torch.bfloat16)
    for name in ("static", "token", "group", "group_reshape", "group_rows"):
        model = M.Layers(comm.group_name, Pattern.NORM_ADD_NORM, "llama", M.QUANTS[name], w1, w2,
                         torch.tensor(1 / 64)).eval()
        backend, graphs = tpcomm.compile_backend("aot_eager"), []
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=lambda gm, ex: graphs.append(gm) or backend(gm, ex), dynamic=True)
        for rows in (6, 4):
            with torch.no_grad():
                M.assert_same(compiled(y[:rows], residual[:rows]), model(y[:rows], residual[:rows], reference=True),
                              f"dynamic {name} {rows} rows")
        # (Dynamo may compile a second graph, for the slice of all 6 rows: each holds the ops with symbolic rows)
        assert graphs and all(M.targets(gm).count(M.FP8_OP) == 2 for gm in graphs), (name, graphs)
        assert backend.counts[COUNT_KEY[Pattern.NORM_ADD_NORM]] == 2 * len(graphs), (name, backend.counts)
        assert all(isinstance(gm.graph.find_nodes(op="placeholder")[0].meta["example_value"], torch.SymInt)
                   for gm in graphs), name
    comm.close()


def test_dynamic_shapes():
    run_ranks(2, _body_dynamic, timeout=600)
