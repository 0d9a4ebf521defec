"""all_reduce_add_rms_norm without a GPU: the unfused path (all-reduce in
fp32 through the dispatcher, then torch) on gloo ranks against the fp32
reference, the in-place variant, the dispatcher-level torch op, errors, the
route to the fused kernel, the raw op's schema and the fake shapes."""
import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import tpcomm
from tpcomm import _lib, _testing, add_rms_norm, routing
from tpcomm.config import Config
from tpcomm.reference import rank_order_sum, reference_add_rms_norm, ulp_distance

from multiproc import run_ranks
from routing_only import meta, routing_comm

KiB = 1024
MiB = 1024 * KiB
SHAPES = [(1, 64), (3, 128), (2, 2, 256), (5, 4096)]


def _inputs(rank, shape, dtype, seed, world_size):
    """Random floats on 2 ranks, where a + b is the same in every order; on
    more ranks multiples of 1/8 below 8, whose sums are exact in fp32 in any
    order (gloo's order is not the reference's rank order)."""
    g = torch.Generator().manual_seed(100 * seed + rank)
    if world_size == 2:
        return (torch.randn(shape, generator=g) * (1 + rank)).to(dtype)
    return (torch.randint(-64, 65, shape, generator=g) / 8).to(dtype)


def _shared(shape, dtype, seed):
    """Residual and weight: the same on every rank, as in tensor parallelism."""
    g = torch.Generator().manual_seed(7919 * seed)
    return torch.randn(shape, generator=g).to(dtype), (torch.rand(shape[-1:], generator=g) + 0.5).to(dtype)


def _body_unfused_matches_the_reference(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    for seed, (shape, dtype) in enumerate([(s, d) for s in SHAPES for d in (torch.bfloat16, torch.float16,
                                                                             torch.float32)]):
        x = _inputs(rank, shape, dtype, seed, world_size)
        residual, weight = _shared(shape, dtype, seed)
        assert comm.route_all_reduce_add_rms_norm(x, weight) == "unfused"
        x_before, residual_before = x.clone(), residual.clone()
        normed, summed = comm.all_reduce_add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "out of place wrote its inputs"
        ref_normed, ref_summed = reference_add_rms_norm(
            [_inputs(r, shape, dtype, seed, world_size) for r in range(world_size)], residual, weight, 1e-5)
        what = f"{dtype} {shape} on {world_size} ranks"
        # the sums are the reference's bit for bit (see _inputs), and the norm
        # is the same fp32 torch expression as the reference's: equal bits
        assert int(ulp_distance(summed, ref_summed).max()) == 0, f"residual_out {what}"
        assert int(ulp_distance(normed, ref_normed).max()) == 0, f"normed {what}"
        # every rank holds the same bits
        for t, name in ((normed, "normed"), (summed, "residual_out")):
            gathered = [torch.empty_like(t) for _ in range(world_size)]
            dist.all_gather(gathered, t)
            assert all(torch.equal(g, gathered[0]) for g in gathered), f"{name} differs across ranks: {what}"
        # in place: the same bits, written into x and residual
        xi, ri = x.clone(), residual.clone()
        out = comm.all_reduce_add_rms_norm(xi, ri, weight, 1e-5, in_place=True)
        assert out[0] is xi and out[1] is ri
        assert torch.equal(xi, normed) and torch.equal(ri, summed), f"in place {what}"
        # the dispatcher-level op of the group
        n2, s2 = torch.ops.tpcomm.custom_all_reduce_add_rms_norm(x, residual, weight, 1e-5, comm.group_name)
        assert torch.equal(n2, normed) and torch.equal(s2, summed), f"torch op {what}"
    # a non-contiguous input and residual, in place: written back through the views
    base = _inputs(rank, (4, 128), torch.bfloat16, 99, world_size)
    res_base, weight = _shared((4, 128), torch.bfloat16, 99)
    x, residual = base[:, ::2], res_base[:, ::2]
    normed, summed = comm.all_reduce_add_rms_norm(x, residual, weight[::2], 1e-6)
    comm.all_reduce_add_rms_norm(x, residual, weight[::2], 1e-6, in_place=True)
    assert torch.equal(x, normed) and torch.equal(residual, summed)
    stats = comm.stats()
    assert stats[("all_reduce_add_rms_norm", "unfused")]["calls"] == 3 * len(SHAPES) * 3 + 2
    # a fused call counts once, under its own key: its all-reduce is not counted again
    assert set(stats) == {("all_reduce_add_rms_norm", "unfused")}, stats
    comm.close()


def test_unfused_on_two_ranks():
    run_ranks(2, _body_unfused_matches_the_reference)


def test_unfused_on_three_ranks():
    run_ranks(3, _body_unfused_matches_the_reference)


class _RankOrderReduceScatter:
    """Stands in for tpcomm's kernels on gloo: reduce_scatter_f32 as the
    kernel computes it (every rank's rows summed in fp32 in rank order from
    -0.0, not rounded), so the "split" route's composition can run on CPUs."""

    def reduce_scatter_f32(self, parts, algo):
        world, rank = dist.get_world_size(), dist.get_rank()
        every = [torch.empty_like(parts) for _ in range(world)]
        dist.all_gather(every, parts.contiguous())
        return rank_order_sum(every).chunk(world)[rank].contiguous()


def _body_split_route(rank, world_size):
    """The "split" route (reduce-scatter in fp32, the norm on this rank's
    rows, all-gather of both results): z bit for bit the reference's, normed
    within 1 ulp, the same on every rank, in place and out of place."""
    comm = tpcomm.Communicator(device="cpu")
    comm._kernels = _RankOrderReduceScatter()
    for seed, (shape, dtype) in enumerate([((6, 64), torch.bfloat16), ((2, 3, 128), torch.float16),
                                           ((12, 48), torch.bfloat16)]):
        x = _inputs(rank, shape, dtype, seed, world_size)
        residual, weight = _shared(shape, dtype, seed)
        normed, summed = add_rms_norm.by_rows(comm, x, residual, weight, 1e-5)
        assert normed.shape == x.shape and summed.shape == x.shape and normed.dtype == dtype
        ref_normed, ref_summed = reference_add_rms_norm(
            [_inputs(r, shape, dtype, seed, world_size) for r in range(world_size)], residual, weight, 1e-5)
        what = f"{dtype} {shape} on {world_size} ranks"
        assert int(ulp_distance(summed, ref_summed).max()) == 0, f"residual_out {what}"
        assert int(ulp_distance(normed, ref_normed).max()) <= 1, f"normed {what}"
        for t in (normed, summed):
            gathered = [torch.empty_like(t) for _ in range(world_size)]
            dist.all_gather(gathered, t.contiguous())
            assert all(torch.equal(g, gathered[0]) for g in gathered), what
    comm.close()


def test_split_route_on_two_and_three_ranks():
    run_ranks(2, _body_split_route)
    run_ranks(3, _body_split_route)


def _body_errors(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    r, w = torch.zeros_like(x), torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual of the input's shape"):
        comm.all_reduce_add_rms_norm(x, r[:1], w)
    with pytest.raises(ValueError, match="weight of its last dimension"):
        comm.all_reduce_add_rms_norm(x, r, w[:32])
    with pytest.raises(TypeError, match="residual of its dtype"):
        comm.all_reduce_add_rms_norm(x, r.float(), w)
    with pytest.raises(TypeError, match="floating-point input"):
        comm.all_reduce_add_rms_norm(x.to(torch.int32), r.to(torch.int32), w)
    with pytest.raises(ValueError, match=r"eps=-1\.0 must be a number in \[0, 1\]"):
        comm.all_reduce_add_rms_norm(x, r, w, -1.0)
    with pytest.raises(ValueError, match="residual is on meta"):
        comm.all_reduce_add_rms_norm(x, r.to("meta"), w)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        comm.all_reduce_add_rms_norm(x, r, [1.0] * 64)
    # nothing was collective: a later op still matches on every rank
    assert comm.all_reduce(torch.ones(4))[0].item() == world_size
    comm.close()


def test_errors_name_what_is_wrong():
    run_ranks(2, _body_errors)


# The route is plain Python over shapes and the configuration; checked on a
# Communicator whose set-up is skipped and that pretends to be enabled.
def test_route_to_the_fused_kernel():
    c = routing_comm()
    w = meta((4096,))
    assert c.route_all_reduce_add_rms_norm(meta((1, 4096)), w) == "fused"
    assert c.route_all_reduce_add_rms_norm(meta((128, 4096)), w) == "fused"        # 1 MiB: the packet cap
    assert c.route_all_reduce_add_rms_norm(meta((129, 4096)), w) == "unfused"      # over it, 129 rows for 2 ranks
    assert c.route_all_reduce_add_rms_norm(meta((130, 4096)), w) == "split"         # 65 rows a rank
    assert c.route_all_reduce_add_rms_norm(meta((2048, 4096)), w) == "split"        # 16 MiB: max_bytes
    assert c.route_all_reduce_add_rms_norm(meta((2050, 4096)), w) == "unfused"     # over it: NCCL's
    assert routing_comm(world_size=4).route_all_reduce_add_rms_norm(meta((130, 4096)), w) == "unfused"  # 130 % 4
    assert routing_comm(world_size=4).route_all_reduce_add_rms_norm(meta((132, 4096)), w) == "split"
    assert routing_comm(forbid=("packet", "bulk")).route_all_reduce_add_rms_norm(meta((130, 4096)), w) == "unfused"
    assert c.route_all_reduce_add_rms_norm(meta((1, 4096), torch.float16), meta((4096,), torch.float16)) == "fused"
    assert c.route_all_reduce_add_rms_norm(meta((1, 4096), torch.float32), meta((4096,), torch.float32)) == "unfused"
    assert c.route_all_reduce_add_rms_norm(meta((1, 4096)), meta((4096,), torch.float32)) == "unfused"  # weight
    row = _lib.NORM_MAX_ROW_BYTES // 2
    assert c.route_all_reduce_add_rms_norm(meta((2, row)), meta((row,))) == "fused"
    assert c.route_all_reduce_add_rms_norm(meta((1, row + 8)), meta((row + 8,))) == "unfused"  # row too long
    assert c.route_all_reduce_add_rms_norm(meta((2, row + 8)), meta((row + 8,))) == "split"  # for the kernel
    assert c.route_all_reduce_add_rms_norm(meta((2, 36)), meta((36,))) == "unfused"  # 72-byte rows
    assert c.route_all_reduce_add_rms_norm(meta((0, 64)), meta((64,))) == "unfused"
    assert routing_comm(fused_kernel=False).route_all_reduce_add_rms_norm(meta((1, 4096)), w) == "unfused"
    assert routing_comm(enabled=False).route_all_reduce_add_rms_norm(meta((1, 4096)), w) == "unfused"
    assert routing_comm(packet_max_bytes=64 * KiB).route_all_reduce_add_rms_norm(meta((9, 4096)), w) == "unfused"


def test_fused_kernel_switch_is_part_of_the_agreed_configuration(monkeypatch):
    assert Config().fused_kernel is True  # on by default
    monkeypatch.setenv("TPCOMM_FUSED_KERNEL", "0")
    cfg = Config.from_env()
    assert cfg.fused_kernel is False and cfg.describe()["fused_kernel"] == "False"
    monkeypatch.setenv("TPCOMM_FUSED_KERNEL", "maybe")
    with pytest.raises(ValueError, match="TPCOMM_FUSED_KERNEL='maybe'"):
        Config.from_env()


def test_internal_op_schema_and_fake():
    tpcomm.load()
    schema = torch.ops._tpcomm.all_reduce_norm_out.default._schema
    assert str(schema) == ("_tpcomm::all_reduce_norm_out(Tensor input, Tensor residual, Tensor? weight, "
                           "Tensor? next_weight, float eps, float next_eps, float weight_offset, int pattern, "
                           "Tensor(a!) normed, Tensor(b!) stream_out, int comm_id, Tensor? bias=None, "
                           "Tensor? next_bias=None, float residual_scale=1.) -> ()")
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["normed", "stream_out"]
    with _testing.stand_in(2) as comm, FakeTensorMode():
        x = torch.empty(3, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(4096, device="cuda", dtype=torch.bfloat16)
        for pattern, next_weight in ((0, None), (1, None), (2, w)):
            out = torch.ops._tpcomm.all_reduce_norm_out(x, torch.empty_like(x), w, next_weight, 1e-6, 1e-6, 1.0,
                                                        pattern, torch.empty_like(x), torch.empty_like(x),
                                                        comm.comm_id)
            assert out is None
        for pattern, next_weight in ((3, None), (4, None), (5, w)):  # a LayerNorm's optional vectors, and m
            out = torch.ops._tpcomm.all_reduce_norm_out(x, torch.empty_like(x), None, next_weight, 1e-6, 1e-6, 0.0,
                                                        pattern, torch.empty_like(x), torch.empty_like(x),
                                                        comm.comm_id, w, None, 0.5)
            assert out is None


def test_dispatcher_op_schema_and_fake_shapes():
    schema = torch.ops.tpcomm.custom_all_reduce_add_rms_norm.default._schema
    assert str(schema) == ("tpcomm::custom_all_reduce_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, "
                           "str group_name) -> (Tensor, Tensor)")
    with FakeTensorMode():
        x = torch.empty(2, 3, 512, device="cuda", dtype=torch.float16)
        normed, summed = torch.ops.tpcomm.custom_all_reduce_add_rms_norm(
            x, torch.empty_like(x), torch.empty(512, device="cuda", dtype=torch.float16), 1e-6, "any group")
        for t in (normed, summed):
            assert tuple(t.shape) == (2, 3, 512) and t.dtype == torch.float16 and t.device.type == "cuda"


def test_policy_does_not_route_the_fused_op():
    """The fused op has its own route (shape and configuration), not a band
    of the routing table: the table's ops stay the three collectives."""
    assert "all_reduce_add_rms_norm" not in routing.OPS


class _Layer(torch.nn.Module):
    """A row-parallel output followed by the fused add + norm, as a compiled
    model holds it: through the group-name op."""

    def __init__(self, group_name, weight):
        super().__init__()
        self.group_name, self.weight = group_name, weight

    def forward(self, x, residual):
        return torch.ops.tpcomm.custom_all_reduce_add_rms_norm(x * 2.0, residual, self.weight, 1e-5, self.group_name)


def _body_compiled(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    x = _inputs(rank, (3, 64), torch.float32, 11, world_size)
    residual, weight = _shared((3, 64), torch.float32, 11)
    layer = _Layer(comm.group_name, weight)
    eager = layer(x, residual)
    for kwargs in ({"backend": "aot_eager", "fullgraph": True}, {"fullgraph": True}):
        torch._dynamo.reset()
        compiled = torch.compile(layer, **kwargs)
        for _ in range(2):
            got = compiled(x, residual)
            assert all(torch.equal(g, e) for g, e in zip(got, eager)), f"compiled {kwargs}"
    comm.close()


def test_compiled_layer_matches_eager():
    run_ranks(2, _body_compiled, timeout=600)


# ------------------------------------------------------ the compile pass

class _UnfusedLayer(torch.nn.Module):
    """What a model writes: all-reduce, residual add, RMSNorm (and z kept)."""

    def __init__(self, group_name, weight, order="residual first"):
        super().__init__()
        self.group_name, self.weight, self.order = group_name, weight, order

    def forward(self, y, residual):
        reduced = torch.ops.tpcomm.custom_all_reduce(y, self.group_name)
        z = residual + reduced if self.order == "residual first" else reduced + residual
        h = torch.nn.functional.rms_norm(z, (y.shape[-1],), self.weight, 1e-5)
        return h * 1.0, z


class _LlamaStyleLayer(torch.nn.Module):
    """The same with the norm written out, as Hugging Face's LlamaRMSNorm does."""

    def __init__(self, group_name, weight):
        super().__init__()
        self.group_name, self.weight = group_name, weight

    def forward(self, y, residual):
        z = residual + torch.ops.tpcomm.custom_all_reduce(y, self.group_name)
        h = z.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return self.weight * h.to(z.dtype), z


def _capture(model, *args):
    """The graph Dynamo hands a backend, and the backend's count of rewrites."""
    seen = {}

    def spy(gm, example_inputs):
        seen["fused"] = sum(tpcomm.fusion.fuse(gm).values())
        seen["targets"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=spy, fullgraph=True)(*args)
    return out, seen


def _body_pass(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    y = _inputs(rank, (3, 64), torch.float32, 21, world_size)
    residual, weight = _shared((3, 64), torch.float32, 21)
    for order in ("residual first", "all_reduce first"):
        model = _UnfusedLayer(comm.group_name, weight, order)
        eager = model(y, residual)
        (h, z), seen = _capture(model, y, residual)
        assert seen["fused"] == 1, order
        assert torch.ops.tpcomm.custom_all_reduce_add_rms_norm.default in seen["targets"]
        assert torch.ops.tpcomm.custom_all_reduce not in seen["targets"]
        assert torch.equal(z, eager[1]), f"z {order}"  # the same fp32 sum, in another spelling
        torch.testing.assert_close(h, eager[0], rtol=2e-6, atol=2e-6)  # F.rms_norm vs the op's fp32 norm
    model = _LlamaStyleLayer(comm.group_name, weight)
    eager = model(y, residual)
    (h, z), seen = _capture(model, y, residual)
    assert seen["fused"] == 1 and torch.ops.tpcomm.custom_all_reduce_add_rms_norm.default in seen["targets"]
    assert not any(t in seen["targets"] for t in (torch.rsqrt, torch.ops.tpcomm.custom_all_reduce)), seen["targets"]
    assert torch.equal(z, eager[1])
    torch.testing.assert_close(h, eager[0], rtol=2e-6, atol=2e-6)
    # not fused: the all-reduce's result used elsewhere, no weight, another dtype
    class KeepsSum(_UnfusedLayer):
        def forward(self, y, residual):
            reduced = torch.ops.tpcomm.custom_all_reduce(y, self.group_name)
            z = residual + reduced
            return torch.nn.functional.rms_norm(z, (y.shape[-1],), self.weight, 1e-5), reduced

    class NoWeight(_UnfusedLayer):
        def forward(self, y, residual):
            z = residual + torch.ops.tpcomm.custom_all_reduce(y, self.group_name)
            return torch.nn.functional.rms_norm(z, (y.shape[-1],), None, 1e-5)

    class KeepsFloatCopy(_LlamaStyleLayer):  # the norm's fp32 intermediate is returned: not replaceable
        def forward(self, y, residual):
            z = residual + torch.ops.tpcomm.custom_all_reduce(y, self.group_name)
            h = z.to(torch.float32)
            return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(z.dtype), h

    # bf16, as served: the Llama-style norm's casts are recognised for that dtype too
    yb, rb, wb = y.to(torch.bfloat16), residual.to(torch.bfloat16), weight.to(torch.bfloat16)
    _, seen = _capture(_LlamaStyleLayer(comm.group_name, wb), yb, rb)
    assert seen["fused"] == 1
    for model, args in ((KeepsFloatCopy(comm.group_name, weight), (y, residual)),
                        (KeepsSum(comm.group_name, weight), (y, residual)),
                        (NoWeight(comm.group_name, weight), (y, residual)),
                        (_UnfusedLayer(comm.group_name, weight), (y, residual.double()))):
        _, seen = _capture(model, *args)
        assert seen["fused"] == 0, type(model).__name__
    # the backend itself, with inductor after the pass
    torch._dynamo.reset()
    model = _UnfusedLayer(comm.group_name, weight)
    h, z = torch.compile(model, backend=tpcomm.compile_backend(), fullgraph=True)(y, residual)
    eager = model(y, residual)
    assert torch.equal(z, eager[1])
    torch.testing.assert_close(h, eager[0], rtol=2e-6, atol=2e-6)
    assert comm.stats()[("all_reduce_add_rms_norm", "unfused")]["calls"] >= 3
    comm.close()


def test_compile_pass_fuses_all_reduce_add_rms_norm():
    run_ranks(2, _body_pass, timeout=600)
