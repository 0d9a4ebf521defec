"""tpcomm.fp8, the definition of the FP8 epilogues' math, against values
worked out by hand: e4m3 codes as bytes (sign, 4 exponent bits of bias 7, 3
mantissa bits), rounding ties to even, saturation at +-448 and beyond (inf
included), dynamic scales (amax / 448, floored), all-zero rows and groups
(the floor), NaN rows and groups (NaN scale and codes, there only), inf in a
dynamic row; the layouts of the scales (row-major, column-major); the modes'
codes against csrc/tpcomm.h; argument errors with their messages."""
import math

import numpy as np

import pytest
import torch

from tpcomm import _constants, fp8
from tpcomm.fp8 import Quant

BF16 = torch.bfloat16
NAN = float("nan")
INF = float("inf")


def _bytes(codes):
    return codes.view(torch.uint8).tolist()


def _f32(v):
    return torch.tensor(v, dtype=torch.float32)


def test_modes_and_group_are_the_headers():
    """tpcomm.fp8's modes and group are csrc/tpcomm.h's (through tpcomm._constants)."""
    header = {"TPC_QUANT_NONE": 0, "TPC_QUANT_PER_TENSOR": 1, "TPC_QUANT_PER_TOKEN": 2,
              "TPC_QUANT_PER_TOKEN_GROUP": 3, "TPC_FP8_GROUP": 128}
    for name, value in header.items():
        assert getattr(_constants, name) == value, name
    assert [(q.name, int(q)) for q in Quant] == [("PER_TENSOR", 1), ("PER_TOKEN", 2), ("PER_TOKEN_GROUP", 3)]
    assert fp8.GROUP == 128 and fp8.FP8_MAX == 448.0 and fp8.DTYPE == torch.float8_e4m3fn


def test_default_floors_are_fp32_values_of_vllms():
    per_token = fp8.DEFAULT_FLOOR[Quant.PER_TOKEN]
    assert per_token == float(_f32(1.0) / _f32(448.0 * 512.0))
    assert per_token == float(_f32(1 / (448 * 512)))  # one rounding of the exact quotient
    group = fp8.DEFAULT_FLOOR[Quant.PER_TOKEN_GROUP]
    assert group == float(_f32(1e-10) / _f32(448.0))
    # max(amax, 1e-10) / 448 (DeepSeek's) and the floored amax / 448 agree at and around 1e-10
    for amax in (0.0, 1e-12, float(_f32(1e-10)), 1.0000001e-10, 1e-9, 3.0):
        a = _f32(amax)
        theirs = torch.maximum(a, _f32(1e-10)) / 448.0
        s = a / 448.0
        ours = torch.where(s < group, _f32(group), s)
        assert torch.equal(theirs, ours), amax


# ------------------------------------------------------------ per tensor

def test_per_tensor_rounds_ties_to_even_and_saturates():
    x = torch.tensor([1.0, 1.0625, 1.0625 + 2 ** -7, 1.1875, 17.0, 19.0, 448.0, 449.0, 464.0, 1e6, -448.0, -1e6,
                      INF, -INF, 2 ** -9, 2 ** -10, 3 * 2 ** -10, 0.0, -0.0], dtype=BF16)
    codes, scales = fp8.quantize(x, "per_tensor", _f32([1.0]))
    assert _bytes(codes) == [0x38,  # 1.0
                             0x38,  # the tie 1.0625 between 1.0 (mantissa 000) and 1.125 (001): even, 1.0
                             0x39,  # just above the tie: 1.125
                             0x3A,  # the tie 1.1875 between 1.125 (001) and 1.25 (010): 1.25
                             0x58,  # 17 between 16 (000) and 18 (001): 16
                             0x5A,  # 19 between 18 (001) and 20 (010): 20
                             0x7E, 0x7E, 0x7E, 0x7E,  # 448 = 1.75 * 2^8, and everything above saturates to it
                             0xFE, 0xFE,  # -448
                             0x7E, 0xFE,  # +-inf saturate too
                             0x01,  # 2^-9, the smallest subnormal
                             0x00,  # 2^-10, the tie between 0 and 2^-9: 0
                             0x02,  # 3 * 2^-10 between 2^-9 (001) and 2^-8 (010): 2^-8
                             0x00, 0x80]
    assert scales.dtype == torch.float32 and scales.shape == (1,) and scales.item() == 1.0


def test_per_tensor_divides_in_fp32_and_keeps_nan():
    scale = _f32(3.0)  # a 0-dim scale: one element is what counts
    x = torch.tensor([[3.0, -6.0, 1.0, NAN], [1344.0, 0.5, 2.0, 7.0]], dtype=torch.float16)
    codes, scales = fp8.quantize(x, Quant.PER_TENSOR, scale)
    q = codes.float()
    assert torch.isnan(q).tolist() == [[False, False, False, True], [False] * 4]  # NaN stays, elsewhere nothing
    assert q[0, :3].tolist() == [1.0, -2.0, float((_f32(1.0) / 3).to(fp8.DTYPE).float())]
    assert q[1].tolist() == [448.0, float((_f32(0.5) / 3).to(fp8.DTYPE).float()),
                             float((_f32(2.0) / 3).to(fp8.DTYPE).float()), 2.25]  # 7/3 = 2.33: 2.25 (step 0.25)
    assert scales.shape == (1,) and scales.item() == 3.0 and scales.data_ptr() != scale.data_ptr()
    # a division, never a multiplication by a reciprocal: 1/3 rounded times 3 is not 1 in every case
    v = torch.tensor([2 ** k * 1.5 for k in range(-6, 8)], dtype=torch.float32)
    for s in (3.0, 7.0, 0.1):
        got, _ = fp8.quantize(v, "per_tensor", _f32(s))
        assert torch.equal(got.view(torch.uint8), (v / _f32(s)).clamp(-448, 448).to(fp8.DTYPE).view(torch.uint8))


# ------------------------------------------------------------- per token

def test_per_token_scales_by_the_rows_amax():
    x = torch.tensor([[1.0, -2.0, 3.5, 0.0],  # amax 3.5: s = 2^-7, codes 128, -256, 448, 0
                      [448.0, 1.0625, 17.0, -19.0],  # s = 1: ties to even as above
                      [0.0, 0.0, 0.0, 0.0],  # all zero: the floor, codes 0
                      [1.0, NAN, 2.0, 3.0],  # NaN: the row's scale and codes NaN
                      [INF, 1.0, -2.0, 0.0]], dtype=BF16)  # inf: s = inf, finite / inf = +-0, inf / inf NaN
    codes, scales = fp8.quantize(x, "per_token")
    floor = fp8.DEFAULT_FLOOR[Quant.PER_TOKEN]
    assert scales.shape == (5, 1) and scales.stride() == (1, 1) and scales.dtype == torch.float32
    s = scales.flatten().tolist()
    assert s[:3] == [2 ** -7, 1.0, floor] and math.isnan(s[3]) and s[4] == INF
    b = _bytes(codes)
    assert b[0] == [0x70, 0xF8, 0x7E, 0x00]  # 128 = 2^7, -256 = -2^8, 448
    assert b[1] == [0x7E, 0x38, 0x58, 0xDA]
    assert b[2] == [0, 0, 0, 0]
    assert all(v in (0x7F, 0xFF) for v in b[3])  # NaN (torch keeps the sign: compare positions)
    assert b[4][0] in (0x7F, 0xFF) and b[4][1:] == [0x00, 0x80, 0x00]


def test_floor_boundary_and_a_floor_of_ones_own():
    floor = 2 ** -10
    x = torch.tensor([[448 * 2 ** -10, 2 ** -11],  # amax / 448 == floor exactly: kept
                      [0.25, -0.125],  # 0.25 / 448 < floor: the floor, codes x / floor = 256, -128
                      [448 * 2 ** -10 * 1.0078125, 0.0]], dtype=BF16)  # just above: its own scale
    codes, scales = fp8.quantize(x, "per_token", floor=floor)
    s = scales.flatten().tolist()
    assert s[0] == floor and s[1] == floor and s[2] == float(_f32(x[2, 0].item()) / 448.0) and s[2] > floor
    assert _bytes(codes)[0] == [0x7E, 0x30]  # 448, 0.5 (0 0110 000)
    assert _bytes(codes)[1] == [0x78, 0xF0]  # 256, -128
    assert _bytes(codes)[2] == [0x7E, 0x00]


# ---------------------------------------------------- per token group

def test_per_token_group_is_per_token_on_each_group_of_128():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 512, generator=g) * 4).to(BF16)
    x[0, 128:256] = 0.0  # one all-zero group: the floor there only
    x[1, 300] = NAN  # one NaN: its group (2) only
    x[2, 0] = 1000.0  # a large value: its group's scale, the others' unchanged
    codes, scales = fp8.quantize(x, "per_token_group")
    assert scales.shape == (3, 4) and scales.is_contiguous()
    floor = fp8.DEFAULT_FLOOR[Quant.PER_TOKEN_GROUP]
    for row in range(3):
        for group in range(4):
            part = x[row:row + 1, 128 * group:128 * (group + 1)]
            want_codes, want_scale = fp8.quantize(part, "per_token", None, floor)
            got = codes[row, 128 * group:128 * (group + 1)]
            assert torch.equal(torch.isnan(got.float()), torch.isnan(want_codes.float()[0])), (row, group)
            keep = ~torch.isnan(want_codes.float()[0])
            assert torch.equal(got.view(torch.uint8)[keep], want_codes.view(torch.uint8)[0][keep]), (row, group)
            assert torch.equal(scales[row, group], want_scale[0, 0]) or (
                math.isnan(scales[row, group]) and math.isnan(want_scale[0, 0])), (row, group)
    assert scales[0, 1].item() == floor and _bytes(codes[0, 128:256]) == [0] * 128
    assert math.isnan(scales[1, 2]) and not torch.isnan(scales[1, [0, 1, 3]]).any()
    assert torch.isnan(codes[1, 256:384].float()).all() and not torch.isnan(codes[1, :256].float()).any()
    assert scales[2, 0].item() == float(_f32(1000.0) / 448.0)


def test_column_major_scales_are_the_same_values_transposed_in_memory():
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    codes, rows = fp8.quantize(x, "per_token_group")
    codes_c, cols = fp8.quantize(x, "per_token_group", None, None, True)
    assert cols.shape == (5, 3) and cols.stride() == (1, 5) and rows.stride() == (3, 1)
    assert torch.equal(cols, rows) and torch.equal(codes_c.view(torch.uint8), codes.view(torch.uint8))
    _, tok = fp8.quantize(x, "per_token", column_major_scales=True)
    assert tok.shape == (5, 1) and tok.stride() == (1, 5)
    assert torch.equal(tok, fp8.quantize(x, "per_token")[1])


def test_scales_shape_of_more_dims():
    x = torch.randn(2, 3, 256).to(BF16)
    assert fp8.quantize(x, "per_token")[1].shape == (2, 3, 1)
    assert fp8.quantize(x, "per_token_group")[1].shape == (2, 3, 2)
    assert fp8.quantize(x, "per_token_group")[0].shape == (2, 3, 256)


def test_the_definition_in_one_expression():
    """quantize() against the contract's formulas written out once more, on values of every magnitude."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(16, 256, generator=g) * torch.logspace(-8, 4, 16).unsqueeze(1)).to(BF16)
    xf = x.float()
    for quant, floor in (("per_token", 1e-3), ("per_token_group", None), ("per_token", None)):
        codes, scales = fp8.quantize(x, quant, None, floor)
        f = fp8.DEFAULT_FLOOR[fp8.NAMES[quant]] if floor is None else floor
        v = xf.view(16, -1, 256 if quant == "per_token" else 128)
        s = v.abs().amax(-1, keepdim=True) / 448.0
        s = torch.where(s < torch.tensor(f, dtype=torch.float32), torch.tensor(f, dtype=torch.float32), s)
        want = (v / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(16, 256)
        assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8)), quant
        assert torch.equal(scales, s.view(scales.shape)), quant


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("call, error, words", [
    (lambda x: fp8.quantize(x, "per_tensor", torch.tensor([1.0], dtype=torch.float64)), TypeError,
     "scale must be float32"),
    (lambda x: fp8.quantize(x, "per_tensor", torch.ones(2)), ValueError, "one element"),
    (lambda x: fp8.quantize(x, "per_tensor", None), TypeError, "needs a scale tensor"),
    (lambda x: fp8.quantize(x, "per_tensor", 1.0), TypeError, "needs a scale tensor"),
    (lambda x: fp8.quantize(x, "per_tensor", torch.ones(1, device="meta")), ValueError, "is on meta"),
    (lambda x: fp8.quantize(x, "per_tensor", torch.ones(1), 1e-3), ValueError, "scale_floor applies"),
    (lambda x: fp8.quantize(x, "per_tensor", torch.ones(1), None, True), ValueError, "per_tensor has one scale"),
    (lambda x: fp8.quantize(x, "per_token", torch.ones(1)), ValueError, "takes no scale"),
    (lambda x: fp8.quantize(x, "per_token", None, 0.0), ValueError, "finite and > 0"),
    (lambda x: fp8.quantize(x, "per_token", None, -1.0), ValueError, "finite and > 0"),
    (lambda x: fp8.quantize(x, "per_token", None, INF), ValueError, "finite and > 0"),
    (lambda x: fp8.quantize(x, "per_token", None, NAN), ValueError, "finite and > 0"),
    (lambda x: fp8.quantize(x, "per_token", None, 1e-50), ValueError, "finite and > 0"),  # 0 in fp32
    (lambda x: fp8.quantize(x, "per_token", None, 1e39), ValueError, "finite and > 0"),  # inf in fp32
    (lambda x: fp8.quantize(x, "per_token", None, "1e-3"), TypeError, "scale_floor must be a number"),
    (lambda x: fp8.quantize(x[:, :192], "per_token_group"), ValueError, "multiple of 128, got 192"),
    (lambda x: fp8.quantize(x.view(2, 2, 256), "per_token_group", None, None, True), ValueError, "2-D input"),
    (lambda x: fp8.quantize(x, "per_row"), ValueError, "unknown FP8 quantization 'per_row'"),
    (lambda x: fp8.quantize(x, 0), ValueError, "unknown FP8 quantization 0"),
    (lambda x: fp8.quantize(x, True), ValueError, "unknown FP8 quantization True"),
    (lambda x: fp8.quantize(x.double(), "per_token"), TypeError, "got torch.float64"),
    (lambda x: fp8.quantize(x[:, :0], "per_token"), ValueError, "non-empty last dimension"),
])
def test_argument_errors(call, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace("+", r"\+")):
        call(torch.ones(4, 256, dtype=BF16))


def test_floors_accepted_as_fp32():
    codes, scales = fp8.quantize(torch.zeros(1, 128, dtype=BF16), "per_token", None, 0.1)
    assert scales.item() == float(_f32(0.1)) and _bytes(codes) == [[0] * 128]
    assert fp8.check_floor(Quant.PER_TOKEN, 1) == 1.0


def test_dynamic_scales_divide_on_every_device():
    """amax / 448 is a division, correctly rounded (numpy's fp32 division),
    never the product with 1/448 that torch computes for a Python-number
    divisor on CUDA: the two differ in about half of these rows."""
    torch.manual_seed(0)
    x = (torch.rand(4096, 128) * 10).to(torch.bfloat16)
    _, scales = fp8.quantize(x, "per_token")
    amax = x.float().abs().amax(-1).numpy()
    divided = torch.from_numpy(np.maximum(amax / np.float32(448.0), np.float32(fp8.DEFAULT_FLOOR[fp8.Quant.PER_TOKEN])))
    product = torch.from_numpy(amax * np.float32(1 / 448.0))
    assert torch.equal(scales.reshape(-1), divided)
    assert not torch.equal(scales.reshape(-1), product)
