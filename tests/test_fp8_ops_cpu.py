"""The FP8 epilogue ops as torch sees them (tpcomm.norm_fp8 behind them):
their schemas as registered, their fake outputs (shapes, strides, dtypes,
the column-major scales' too) under FakeTensorMode on CUDA tensors and in a
graph compiled with fullgraph=True on 2 gloo ranks (the same layouts and
bits as eager), and the Kernels wrapper's call of the C++ binding's op in
the order of its schema (spec/fp8.md)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tpcomm
from tpcomm.fp8 import Quant
from tpcomm.norm_patterns import Pattern

from multiproc import run_ranks

PRIVATE_SCHEMA = ("_tpcomm::all_reduce_norm_fp8(Tensor x, Tensor residual, Tensor? weight, Tensor? next_weight, "
                  "float eps, float next_eps, float weight_offset, int pattern, int quant, Tensor? scale, "
                  "float scale_floor, bool column_major_scales, bool return_normed, str group_name, "
                  "Tensor? bias=None, Tensor? next_bias=None, float residual_scale=1.) "
                  "-> (Tensor codes, Tensor scales, Tensor stream, Tensor normed)")
PUBLIC_SCHEMA = ("tpcomm::custom_all_reduce_add_rms_norm_fp8(Tensor x, Tensor residual, Tensor weight, float eps, "
                 "str quant, Tensor? scale, float? scale_floor, bool column_major_scales, str group_name) "
                 "-> (Tensor codes, Tensor scales, Tensor summed)")


def _bits(t):
    return t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2
                               else torch.int32)

# --------------------------------------------------------- schemas, fakes

def test_schemas_as_registered():
    assert str(torch.ops._tpcomm.all_reduce_norm_fp8.default._schema) == PRIVATE_SCHEMA
    assert str(torch.ops.tpcomm.custom_all_reduce_add_rms_norm_fp8.default._schema) == PUBLIC_SCHEMA
    assert not torch.ops._tpcomm.all_reduce_norm_fp8.default._schema.is_mutable
    assert not torch.ops.tpcomm.custom_all_reduce_add_rms_norm_fp8.default._schema.is_mutable


def _layout(t):
    return tuple(t.shape), t.stride(), t.dtype


def test_fake_outputs_on_cuda_tensors():
    """The fakes' shapes, strides and dtypes, for CUDA tensors (what the
    kernel route sees under torch.compile), without a GPU or a group."""
    with FakeTensorMode():
        x = torch.empty(5, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(256, device="cuda", dtype=torch.bfloat16)
        scale = torch.empty((), device="cuda")
        for quant, column_major, scales in ((Quant.PER_TENSOR, False, ((1,), (1,))),
                                            (Quant.PER_TOKEN, False, ((5, 1), (1, 1))),
                                            (Quant.PER_TOKEN, True, ((5, 1), (1, 5))),
                                            (Quant.PER_TOKEN_GROUP, False, ((5, 2), (2, 1))),
                                            (Quant.PER_TOKEN_GROUP, True, ((5, 2), (1, 5)))):
            s = scale if quant == Quant.PER_TENSOR else None
            for return_normed in (False, True):
                codes, sc, stream, normed = torch.ops._tpcomm.all_reduce_norm_fp8(
                    x, x, w, w, 1e-6, 1e-6, 1.0, int(Pattern.NORM_ADD_NORM), int(quant), s, 1e-3, column_major,
                    return_normed, "no-group-needed")
                assert _layout(codes) == ((5, 256), (256, 1), torch.float8_e4m3fn) and codes.device.type == "cuda"
                assert _layout(sc) == scales + (torch.float32,) and sc.device.type == "cuda"
                assert _layout(stream) == ((5, 256), (256, 1), torch.bfloat16)
                assert _layout(normed) == (((5, 256), (256, 1)) if return_normed else ((0,), (1,))) + (torch.bfloat16,)
            name = quant.name.lower()
            codes, sc, summed = torch.ops.tpcomm.custom_all_reduce_add_rms_norm_fp8(
                x, x, w, 1e-6, name, s, None, column_major, "no-group-needed")
            assert _layout(sc) == scales + (torch.float32,) and _layout(summed) == _layout(x)
        with pytest.raises(ValueError, match="multiple of 128"):
            torch.ops.tpcomm.custom_all_reduce_add_rms_norm_fp8(x[:, :192], x[:, :192], w[:192], 1e-6,
                                                                "per_token_group", None, None, False, "g")


class _Fp8Layer(torch.nn.Module):
    def __init__(self, group, w, nw, quant, scale, column_major):
        super().__init__()
        self.group, self.w, self.nw, self.quant, self.scale = group, w, nw, quant, scale
        self.column_major = column_major

    def forward(self, y, residual):
        codes, scales, summed = torch.ops.tpcomm.custom_all_reduce_add_rms_norm_fp8(
            y * 2.0, residual, self.w, 1e-6, self.quant.name.lower(), self.scale, None, self.column_major, self.group)
        out = torch.ops._tpcomm.all_reduce_norm_fp8(summed, residual, self.w, self.nw, 1e-6, 1e-5, 1.0,
                                                    int(Pattern.NORM_ADD_NORM), int(self.quant), self.scale, 1e-3,
                                                    self.column_major, True, self.group)
        return (codes, scales, summed) + tuple(out)


def _body_compiled(rank, world_size):
    """The ops in a graph compiled with fullgraph=True: what the compiled
    graph returns has the eager call's shapes, strides, dtypes and bits."""
    comm = tpcomm.Communicator(device="cpu")
    g = torch.Generator().manual_seed(3)
    w, nw = torch.randn(256, generator=g).to(torch.bfloat16), torch.randn(256, generator=g).to(torch.bfloat16)
    residual = torch.randn(6, 256, generator=g).to(torch.bfloat16)
    y = (torch.randint(-64, 65, (6, 256), generator=torch.Generator().manual_seed(rank)) / 8).to(torch.bfloat16)
    for quant in Quant:
        for column_major in ((False,) if quant == Quant.PER_TENSOR else (False, True)):
            scale = torch.tensor([0.03]) if quant == Quant.PER_TENSOR else None
            model = _Fp8Layer(comm.group_name, w, nw, quant, scale, column_major)
            torch._dynamo.reset()
            with torch.no_grad():
                got = torch.compile(model, backend="aot_eager", fullgraph=True)(y, residual)
                eager = model(y, residual)
            for i, (a, b) in enumerate(zip(got, eager)):
                what = f"output {i} {quant.name} column-major {column_major}"
                assert _layout(a) == _layout(b), (what, _layout(a), _layout(b))
                assert torch.equal(_bits(a), _bits(b)), what
    comm.close()


def test_compiled_ops_on_two_ranks():
    run_ranks(2, _body_compiled, timeout=300)


# ------------------------------------------------- the C++ binding's op

BINDING_SCHEMA = ("_tpcomm::all_reduce_norm_quant_out(Tensor input, Tensor residual, Tensor? weight, "
                  "Tensor? next_weight, float eps, float next_eps, float weight_offset, int pattern, int quant, "
                  "float scale_floor, Tensor(a!)? normed, Tensor(b!) stream_out, Tensor(c!) codes, "
                  "Tensor(d!) scales, int comm_id, Tensor? bias=None, Tensor? next_bias=None, "
                  "float residual_scale=1.) -> ()")


def test_kernels_wrapper_calls_the_binding_in_its_argument_order():
    """Kernels.all_reduce_norm_quant hands the binding's op (spec/fp8.md's
    schema; the registered one where the build has it) its arguments in
    the schema's order, with Python numbers of the schema's types."""
    from tpcomm.backends.kernels import Kernels

    schema = torch._C.parse_schema(BINDING_SCHEMA)
    if hasattr(torch.ops._tpcomm, "all_reduce_norm_quant_out"):
        assert str(torch.ops._tpcomm.all_reduce_norm_quant_out.default._schema) == BINDING_SCHEMA
    kernels, seen = object.__new__(Kernels), []
    kernels.comm_id = 77
    kernels._norm_quant_out = lambda *args: seen.append(args)
    x, r, w, nw, stream, codes, scales, b, nb = (torch.empty(1) for _ in range(9))
    named = dict(input=x, residual=r, weight=w, next_weight=nw, eps=1e-5, next_eps=1e-6, weight_offset=1.0,
                 pattern=int(Pattern.LAYER_NORM_ADD_LAYER_NORM), quant=int(Quant.PER_TOKEN_GROUP),
                 scale_floor=2.0 ** -12, normed=None, stream_out=stream, codes=codes, scales=scales, comm_id=77,
                 bias=b, next_bias=nb, residual_scale=-0.5)
    kernels.all_reduce_norm_quant(Pattern.LAYER_NORM_ADD_LAYER_NORM, Quant.PER_TOKEN_GROUP, x, r, w, nw, 1e-5, 1e-6, 1,
                                  2 ** -12, None, stream, codes, scales, b, nb, residual_scale=-0.5)
    assert len(seen) == 1 and len(seen[0]) == len(schema.arguments)
    for got, arg in zip(seen[0], schema.arguments):
        want = named[arg.name]
        assert got is want if isinstance(want, torch.Tensor) or want is None else (got == want and
                                                                                   type(got) is type(want)), arg.name
