"""tpcomm.quantized_reference without a GPU: its emulation of the quantized
all-reduce stays within the error bound docs/design.md derives, on the four
kinds of data the GPU tests use (uniform, Student-t, an outlier group,
all-zero), at 2, 3, 4 and 8 ranks, for every mode and 16-bit dtype; its e4m3
codes are those of csrc/kernels/quant.cuh's encoder (ported bit for bit
below); NaN and inf poison their group only."""
import struct

import pytest
import torch

import quantized_data
from tpcomm import quantized_reference as ref

WORLDS = (2, 3, 4, 8)
DTYPES = (torch.bfloat16, torch.float16)


def data(kind, world, numel, dtype, seed=0):
    return quantized_data.inputs(kind, world, numel, dtype, seed)


KINDS = quantized_data.KINDS


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ref.MODES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_emulation_within_the_bound(world, mode, kind, dtype):
    numel = 8 * 1000  # 1000 units: chunks not a multiple of a group at 3 and 8 ranks, a short last group
    inputs = data(kind, world, numel, dtype, seed=world)
    out = ref.emulate(inputs, mode)
    limit, exact = ref.bound(inputs, mode)
    err = (out.double() - exact).abs()
    assert out.dtype == dtype and out.shape == inputs[0].shape
    assert torch.isfinite(out).all()
    worst = (err / limit.clamp(min=1e-300)).max().item()
    assert (err <= limit).all(), f"{(err > limit).sum().item()} values over the bound (worst {worst:.3f} of it)"
    if kind == "zero":
        assert (out == 0).all()
    else:
        # the bound is not vacuous: the codes do lose precision, and the
        # worst value comes within a small factor of the bound
        assert (out.double() != exact).any()
        assert worst > 0.05, worst


def test_bound_is_per_group_absmax():
    """An outlier widens the bound of its own group only."""
    inputs = data("outlier", 4, 256, torch.bfloat16)
    limit, _ = ref.bound(inputs, "int8")
    assert limit[64:96].min() > 20 * limit[:64].max()
    assert limit[96:].max() < limit[64:96].min() / 20


def test_chunks_are_whole_groups():
    assert ref.chunk_units(1000, 3) == 336
    assert ref.chunk_units(1000, 8) == 128
    assert ref.chunk_units(4, 8) == 4
    for units in range(1, 200):
        for world in WORLDS:
            c = ref.chunk_units(units, world)
            assert c % ref.GROUP_UNITS == 0 and c * world >= units and (c - ref.GROUP_UNITS) * world < units


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("mode", ref.MODES)
def test_nan_or_inf_poisons_its_group_only(bad, mode):
    inputs = data("uniform", 3, 512, torch.bfloat16)
    inputs[1][100] = bad  # group 3: values 96..127
    out = ref.emulate(inputs, mode)
    assert torch.isnan(out[96:128]).all()
    assert torch.isfinite(out[:96]).all() and torch.isfinite(out[128:]).all()


def test_tiny_groups_decode_to_zero():
    inputs = [torch.full((64,), 2.0 ** -70, dtype=torch.bfloat16) for _ in range(2)]
    inputs[0][32:] = 1.0
    out = ref.emulate(inputs, "int8")
    assert (out[:32] == 0).all()
    assert (out[32:] != 0).all()
    limit, exact = ref.bound(inputs, "int8")
    assert ((out.double() - exact).abs() <= limit).all()


def test_same_bits_twice():
    inputs = data("student_t", 4, 4096, torch.float16)
    for mode in ref.MODES:
        a, b = ref.emulate(inputs, mode), ref.emulate(inputs, mode)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_rejects_unknown_mode():
    with pytest.raises(ValueError, match="int2"):
        ref.emulate(data("zero", 2, 64, torch.bfloat16), "int2")


# --- the e4m3 encoder of csrc/kernels/quant.cuh, ported bit for bit --------

def _bits(f):
    return struct.unpack("<I", struct.pack("<f", f))[0]


def _e4m3_of(y):
    """tpc_e4m3_of: finite |y| <= 448 to e4m3 (RNE; subnormals below 2^-6)."""
    y = struct.unpack("<f", struct.pack("<f", y))[0]
    sign = (_bits(y) >> 24) & 0x80
    a = abs(y)
    if a < 0.015625:
        return sign | int(round(a * 512.0))  # Python's round is to nearest even, as rintf
    b = _bits(a)
    b += 0x7FFFF + ((b >> 20) & 1)
    return sign | ((((b >> 23) - 120) << 3) & 0xFF) | ((b >> 20) & 7)


def test_e4m3_encoder_matches_torch():
    """quant.cuh's software encoder gives torch's float8_e4m3fn codes: every
    code, every midpoint between neighbours (ties to even), and random values
    over the whole range, subnormals included."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[torch.isfinite(codes)]
    values = torch.unique(finite)
    mids = (values[1:].double() + values[:-1].double()) / 2
    g = torch.Generator().manual_seed(1)
    rand = (torch.rand(20000, generator=g) * 2 - 1) * 448
    tiny = (torch.rand(5000, generator=g) * 2 - 1) * 0.02
    ys = torch.cat([values, mids.float(), rand, tiny, torch.tensor([448.0, -448.0, 0.0, -0.0])])
    theirs = ys.to(torch.float8_e4m3fn).view(torch.uint8)
    mine = torch.tensor([_e4m3_of(float(y)) for y in ys], dtype=torch.uint8)
    bad = (mine != theirs).nonzero().flatten()
    assert bad.numel() == 0, [(float(ys[i]), int(mine[i]), int(theirs[i])) for i in bad[:5]]
