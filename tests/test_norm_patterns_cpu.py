"""Every fusion pattern of tpcomm.norm_patterns through the private op
torch.ops._tpcomm.all_reduce_norm on gloo ranks (no kernel: the all-reduce
in fp32, the rest in torch): the fp32 reference bit for bit, the same bits
on every rank, each call counted once under its pattern's key and nothing
else; bad arguments raise before anything collective; which route each
pattern takes (the fused kernel family where ADD_NORM's would) and what the
fused route hands the kernel; and the compile pass's matchers on small
graphs (the sandwich norm with its next norm, a dropout and a reshape
between the all-reduce and the add, a view after the all-reduce of a
non-contiguous tensor, torch.nn.RMSNorm with its default eps)."""
import pytest
import torch
import torch.distributed as dist

import tpcomm
from tpcomm import _constants as C
from tpcomm import norm_patterns, routing
from tpcomm.norm_patterns import NEXT_NORM, STATS_KEY, Pattern
from tpcomm.reference import reference_all_reduce_norm, ulp_distance

from multiproc import run_ranks
from norm_helpers import pattern_inputs, pattern_shared, seeded
from routing_only import meta, routing_comm

SHAPES = [(1, 64), (3, 128), (2, 2, 256)]


def _body_patterns(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    expected = dict.fromkeys(STATS_KEY.values(), 0)
    for seed, pattern, offset, shape, dtype in seeded(Pattern, (0.0, 1.0), SHAPES, (torch.bfloat16, torch.float32)):
        x = pattern_inputs(rank, shape, dtype, seed)
        residual, weight, next_weight = pattern_shared(shape, dtype, seed)
        nw = next_weight if pattern in NEXT_NORM else None
        normed, stream = torch.ops._tpcomm.all_reduce_norm(x, residual, weight, nw, 1e-5, 1e-6, offset, int(pattern),
                                                           comm.group_name)
        expected[STATS_KEY[pattern]] += 1
        ref = reference_all_reduce_norm([pattern_inputs(r, shape, dtype, seed) for r in range(world_size)], residual,
                                        weight, 1e-5, pattern, offset, nw, 1e-6)
        what = f"{pattern.name} offset {offset} {dtype} {shape} on {world_size} ranks"
        assert int(ulp_distance(normed, ref[0]).max()) == 0, f"normed {what}"
        assert int(ulp_distance(stream, ref[1]).max()) == 0, f"stream {what}"
        assert normed.data_ptr() != stream.data_ptr()
        for t in (normed, stream):
            gathered = [torch.empty_like(t) for _ in range(world_size)]
            dist.all_gather(gathered, t)
            assert all(torch.equal(g, gathered[0]) for g in gathered), f"ranks differ: {what}"
    stats = comm.stats()
    # each call once, under its pattern's key; ADD_NORM with weight w is all_reduce_add_rms_norm itself
    assert {op: v["calls"] for (op, _), v in stats.items()} == {k: n for k, n in expected.items() if n}, stats
    x = torch.ones(2, 64)
    with pytest.raises(ValueError, match="next_weight"):
        torch.ops._tpcomm.all_reduce_norm(x, x, x[0], None, 1e-5, 1e-5, 0.0, int(Pattern.NORM_ADD_NORM),
                                          comm.group_name)
    with pytest.raises(ValueError, match="weight_offset"):
        torch.ops._tpcomm.all_reduce_norm(x, x, x[0], None, 1e-5, 1e-5, 0.5, int(Pattern.NORM_ADD), comm.group_name)
    with pytest.raises(ValueError, match="pattern"):
        torch.ops._tpcomm.all_reduce_norm(x, x, x[0], None, 1e-5, 1e-5, 0.0, 7, comm.group_name)
    comm.close()


def test_patterns_on_two_ranks():
    run_ranks(2, _body_patterns)


def test_patterns_on_three_ranks():
    run_ranks(3, _body_patterns)


def test_pattern_is_the_c_enum():
    assert [(p.name, int(p)) for p in Pattern] == [
        ("ADD_NORM", C.TPC_PATTERN_ADD_NORM), ("NORM_ADD", C.TPC_PATTERN_NORM_ADD),
        ("NORM_ADD_NORM", C.TPC_PATTERN_NORM_ADD_NORM), ("ADD_LAYER_NORM", C.TPC_PATTERN_ADD_LAYER_NORM),
        ("LAYER_NORM_ADD", C.TPC_PATTERN_LAYER_NORM_ADD),
        ("LAYER_NORM_ADD_LAYER_NORM", C.TPC_PATTERN_LAYER_NORM_ADD_LAYER_NORM)]
    assert [int(p) for p in Pattern] == list(range(6))


def test_route_of_each_pattern_from_add_norms():
    """Every pattern and offset takes the fused kernel where ADD_NORM does;
    only ADD_NORM with weight w keeps "split" (and a group of one's route);
    a next weight of another dtype stays unfused."""
    bf16 = torch.bfloat16
    for add_norm in ("fused", "split", "unfused", "single rank"):
        assert routing.norm_pattern(add_norm, Pattern.ADD_NORM, 0.0, bf16) == add_norm
        for pattern, offset in ((Pattern.ADD_NORM, 1.0), (Pattern.NORM_ADD, 0.0), (Pattern.NORM_ADD, 1.0),
                                (Pattern.NORM_ADD_NORM, 0.0), (Pattern.NORM_ADD_NORM, 1.0)):
            nw = bf16 if pattern == Pattern.NORM_ADD_NORM else None
            want = "fused" if add_norm == "fused" else "unfused"
            assert routing.norm_pattern(add_norm, pattern, offset, bf16, nw) == want, (add_norm, pattern, offset)
    assert routing.norm_pattern("fused", Pattern.NORM_ADD_NORM, 1.0, bf16, torch.float32) == "unfused"
    assert routing.norm_pattern("fused", Pattern.NORM_ADD_NORM, 0.0, torch.float16, torch.float16) == "fused"


def test_route_of_each_pattern_on_a_communicator():
    c, w = routing_comm(), meta((4096,))
    decode, prefill, fp32 = meta((8, 4096)), meta((130, 4096)), meta((1, 4096), torch.float32)
    for pattern in (Pattern.NORM_ADD, Pattern.NORM_ADD_NORM):
        nw = w if pattern == Pattern.NORM_ADD_NORM else None
        for offset in (0.0, 1.0):
            assert norm_patterns.route(c, pattern, decode, w, nw, offset) == "fused"
            assert norm_patterns.route(c, pattern, prefill, w, nw, offset) == "unfused"  # over the packet cap
            assert norm_patterns.route(c, pattern, fp32, meta((4096,), torch.float32), nw, offset) == "unfused"
            assert norm_patterns.route(routing_comm(fused_kernel=False), pattern, decode, w, nw, offset) == "unfused"
            assert norm_patterns.route(routing_comm(enabled=False), pattern, decode, w, nw, offset) == "unfused"
    row = C.TPC_NORM_MAX_ROW_BYTES // 2
    assert norm_patterns.route(c, Pattern.NORM_ADD, meta((1, row)), meta((row,)), None, 1.0) == "fused"
    assert norm_patterns.route(c, Pattern.NORM_ADD, meta((1, row + 8)), meta((row + 8,)), None, 1.0) == "unfused"
    assert norm_patterns.route(c, Pattern.ADD_NORM, prefill, w, None, 0.0) == "split"
    assert norm_patterns.route(c, Pattern.ADD_NORM, prefill, w, None, 1.0) == "unfused"
    assert norm_patterns.route(c, Pattern.ADD_NORM, decode, w, None, 1.0) == "fused"


class _RecordingKernels:
    """Stands in for backends.kernels.Kernels: records what the fused route
    hands the kernel family and writes distinct values into its outputs."""

    def __init__(self):
        self.calls = []

    def all_reduce_norm(self, pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset, normed,
                        stream_out, bias=None, next_bias=None, residual_scale=1.0):
        self.calls.append((pattern, x, residual, weight, next_weight, eps, next_eps, weight_offset, bias, next_bias,
                           residual_scale))
        normed.fill_(1.0)
        stream_out.fill_(2.0)


def test_fused_route_hands_the_kernel_its_pattern_and_counts_once():
    c = routing_comm()
    c._kernels, c._stat_cells = _RecordingKernels(), {}
    # x not contiguous: the kernel gets a contiguous copy
    x, residual = torch.randn(4, 64, dtype=torch.bfloat16)[:, ::2], torch.randn(4, 32, dtype=torch.bfloat16)
    w, nw = torch.randn(32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    calls = 0
    for pattern in (Pattern.ADD_NORM, Pattern.NORM_ADD, Pattern.NORM_ADD_NORM):
        for offset in ((1.0,) if pattern == Pattern.ADD_NORM else (0.0, 1.0)):
            next_weight = nw if pattern == Pattern.NORM_ADD_NORM else None
            normed, stream = norm_patterns.run(c, int(pattern), x, residual, w, next_weight, 1e-5, 1e-6, offset)
            calls += 1
            got = c._kernels.calls[-1]
            assert got[0] == pattern and got[5:] == (1e-5, 1e-6, offset, None, None, 1.0)
            assert got[1].is_contiguous() and torch.equal(got[1], x) and got[2] is residual and got[3] is w
            assert got[4] is next_weight
            assert normed.shape == x.shape and bool((normed == 1).all()) and bool((stream == 2).all())
            assert normed.data_ptr() != stream.data_ptr()
    assert len(c._kernels.calls) == calls
    assert c.stats() == {
        (STATS_KEY[Pattern.ADD_NORM], "fused"): {"calls": 1, "bytes": x.numel() * 2},
        (STATS_KEY[Pattern.NORM_ADD], "fused"): {"calls": 2, "bytes": 2 * x.numel() * 2},
        (STATS_KEY[Pattern.NORM_ADD_NORM], "fused"): {"calls": 2, "bytes": 2 * x.numel() * 2}}


class _GemmaNorm(torch.nn.Module):
    def __init__(self, weight, eps=1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(weight), eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class _Sandwich(torch.nn.Module):
    """Gemma's sub-layer end: residual + post_norm(all_reduce(y)), then the next pre-norm."""

    def __init__(self, group, w1, w2):
        super().__init__()
        self.group, self.post, self.pre = group, _GemmaNorm(w1), _GemmaNorm(w2)

    def forward(self, y, residual):
        h = residual + self.post(torch.ops.tpcomm.custom_all_reduce(y, self.group))
        return self.pre(h), h


class _DropoutReshape(torch.nn.Module):
    """Phi-3's dropout (p = 0) and MoE code's reshape between the all-reduce and the add."""

    def __init__(self, group, w):
        super().__init__()
        self.group, self.w = group, torch.nn.Parameter(w)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, y, residual):
        h = residual + self.drop(torch.ops.tpcomm.custom_all_reduce(y, self.group).reshape(residual.shape))
        return torch.nn.functional.rms_norm(h, (h.shape[-1],), self.w, 1e-6), h


class _TransposedInput(torch.nn.Module):
    """The all-reduce of a non-contiguous tensor (a transpose), viewed to the residual's shape after it."""

    def __init__(self, group, w):
        super().__init__()
        self.group, self.w = group, torch.nn.Parameter(w)

    def forward(self, y, residual):
        h = residual + torch.ops.tpcomm.custom_all_reduce(y.transpose(0, 1), self.group).view(residual.shape)
        return torch.nn.functional.rms_norm(h, (h.shape[-1],), self.w, 1e-6), h


def _body_compiled(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    g = torch.Generator().manual_seed(3)
    w1, w2 = torch.randn(64, generator=g), torch.randn(64, generator=g)
    residual = torch.randn(2, 3, 64, generator=g)
    y = (torch.randint(-64, 65, (2, 3, 64), generator=torch.Generator().manual_seed(rank)) / 8)
    for model, args, key in ((_Sandwich(comm.group_name, w1, w2), (y, residual), "all_reduce_rms_norm_add_rms_norm"),
                             (_DropoutReshape(comm.group_name, w1).eval(), (y.view(6, 64), residual),
                              "all_reduce_add_rms_norm"),
                             (_TransposedInput(comm.group_name, w1), (y, residual.view(6, 64)),
                              "all_reduce_add_rms_norm")):
        torch._dynamo.reset()
        backend = tpcomm.compile_backend("aot_eager")
        with torch.no_grad():
            got = torch.compile(model, backend=backend, fullgraph=True)(*args)
            eager = model(*args)
        assert backend.counts[key] == 1 and sum(backend.counts[k] for k in STATS_KEY.values()) == 1, backend.counts
        assert torch.equal(got[1], eager[1]), type(model).__name__
        torch.testing.assert_close(got[0], eager[0], rtol=2e-6, atol=2e-6)
    comm.close()


def test_compiled_patterns_on_two_ranks():
    run_ranks(2, _body_compiled)


class _TorchRMSNorm(torch.nn.Module):
    """The residual add, then torch.nn.RMSNorm with its default eps (None)."""

    def __init__(self, group, w):
        super().__init__()
        self.group, self.norm = group, torch.nn.RMSNorm(w.shape[0], dtype=w.dtype)
        with torch.no_grad():
            self.norm.weight.copy_(w)

    def forward(self, y, residual):
        h = residual + torch.ops.tpcomm.custom_all_reduce(y, self.group)
        return self.norm(h), h


def _body_default_eps(rank, world_size):
    """torch.nn.RMSNorm() fuses with the eps torch takes for it: fp32's
    machine epsilon for fp32 and bf16 inputs alike (the type torch computes
    in). The values are small enough (mean(z^2) about 4 eps) that another eps
    (bf16's, or none) gives other results."""
    comm = tpcomm.Communicator(device="cpu")
    for dtype, tolerance in ((torch.float32, 2e-6), (torch.bfloat16, 2 ** -7)):
        g = torch.Generator().manual_seed(5)
        residual = (torch.randint(-8, 9, (4, 64), generator=g) * 2 ** -14).to(dtype)  # z exact in bf16 too
        weight = (torch.rand(64, generator=g) + 0.5).to(dtype)
        y = (torch.randint(-8, 9, (4, 64), generator=torch.Generator().manual_seed(rank)) * 2 ** -14).to(dtype)
        model, graphs = _TorchRMSNorm(comm.group_name, weight), []

        def keep(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(model, backend=tpcomm.compile_backend(keep), fullgraph=True)(y, residual)
            eager = model(y, residual)
        fused = [n for n in graphs[0].graph.nodes if n.target is torch.ops.tpcomm.custom_all_reduce_add_rms_norm.default]
        assert len(fused) == 1, graphs[0].graph
        assert fused[0].args[3] == torch.finfo(torch.float32).eps, (dtype, fused[0].args)
        assert torch.equal(got[1], eager[1]), dtype
        torch.testing.assert_close(got[0], eager[0], rtol=tolerance, atol=0, msg=str(dtype))
    comm.close()


def test_torch_rms_norm_without_eps_fuses_with_torchs_eps():
    run_ranks(2, _body_default_eps)


def test_fusion_does_not_import_the_compile_pass():
    """graph_pass imports fusion, never the other way round, not even inside a
    function (no import circle; tests/test_import_cycles_cpu.py checks them all)."""
    import ast

    import tpcomm.fusion

    tree = ast.parse(open(tpcomm.fusion.__file__).read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names} | {node.module or "" for node in ast.walk(tree)
                                            if isinstance(node, ast.ImportFrom)}
    assert not any("compile_pass" in name or "graph_pass" in name for name in imported), imported
