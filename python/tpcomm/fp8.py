"""FP8 e4m3 quantization of the fused norm's normed output (the epilogues of
tpcomm.norm_fp8): the modes, their constants and default floors, the checks
of their arguments, the layouts of their outputs, and quantize(), the torch
definition of the math that the kernel, the unfused route and the tests
share (docs/design.md, FP8 epilogues).

x is the normed output rounded to the model's dtype (bf16/fp16; fp32 on the
unfused route), read as fp32 (exact). e4m3(v) = v.clamp(-448, 448) cast to
torch.float8_e4m3fn: round to nearest even, saturating; NaN stays NaN.
  PER_TENSOR       q = e4m3(x / scale), scale a given fp32 tensor of one element
  PER_TOKEN        s = amax(|row|) / 448, s = floor where s < floor; q = e4m3(x / s)
  PER_TOKEN_GROUP  the same over each run of GROUP values of a row
Every division is fp32's correctly rounded one (never a reciprocal times);
a NaN in a row (a group) makes its scale and every code of it NaN.
"""
import enum
import math

import torch

from . import _constants as C

class Quant(enum.IntEnum):
    """csrc/tpcomm.h's tpc_norm_quant but NONE."""
    PER_TENSOR = C.TPC_QUANT_PER_TENSOR
    PER_TOKEN = C.TPC_QUANT_PER_TOKEN
    PER_TOKEN_GROUP = C.TPC_QUANT_PER_TOKEN_GROUP


NAMES = {"per_tensor": Quant.PER_TENSOR, "per_token": Quant.PER_TOKEN, "per_token_group": Quant.PER_TOKEN_GROUP}
DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = C.TPC_FP8_GROUP
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _f32(v):
    """The fp32 value of a Python number, as a Python float."""
    return float(torch.tensor(v, dtype=torch.float32))


# The floor of a dynamic scale, in fp32: vLLM's dynamic_per_token_scaled_fp8_quant min_scaling_factor
# 1 / (448 * 512), and fp32(1e-10) / 448, which is DeepSeek's / vLLM's per_token_group_quant_fp8
# max(amax, 1e-10) / 448 bit for bit.
DEFAULT_FLOOR = {
    Quant.PER_TOKEN: float(torch.tensor(1.0) / torch.tensor(FP8_MAX * 512)),
    Quant.PER_TOKEN_GROUP: float(torch.tensor(1e-10, dtype=torch.float32) / torch.tensor(FP8_MAX)),
}


def parse_quant(quant):
    """Quant of a mode's name ("per_tensor", "per_token", "per_token_group"), a Quant or its int."""
    if isinstance(quant, str):
        if quant not in NAMES:
            raise ValueError(f"tpcomm: unknown FP8 quantization {quant!r}; one of {sorted(NAMES)}")
        return NAMES[quant]
    if isinstance(quant, bool) or not isinstance(quant, int) or quant not in Quant.__members__.values():
        raise ValueError(f"tpcomm: unknown FP8 quantization {quant!r}; one of {sorted(NAMES)} "
                         f"(or their codes {[int(q) for q in Quant]})")
    return Quant(quant)


def check_floor(quant, floor):
    """The fp32 floor a dynamic mode uses (its default where floor is None);
    0.0 for PER_TENSOR, which takes none."""
    if quant == Quant.PER_TENSOR:
        if floor is not None:
            raise ValueError("tpcomm: scale_floor applies to the dynamic scales (per_token, per_token_group); "
                             "per_tensor divides by the given scale")
        return 0.0
    if floor is None:
        return DEFAULT_FLOOR[quant]
    if isinstance(floor, bool) or not isinstance(floor, (int, float)):
        raise TypeError(f"tpcomm: scale_floor must be a number, got {type(floor).__name__}")
    f32 = _f32(floor) if math.isfinite(floor) else floor
    if not (math.isfinite(f32) and f32 > 0):
        raise ValueError(f"tpcomm: scale_floor={floor!r} must be finite and > 0 in fp32")
    return f32


def check_args(quant, x, scale=None, floor=None, column_major_scales=False):
    """(Quant, fp32 floor) of a call quantizing x (the input's shape and
    dtype: what the normed output will be); raises TypeError or ValueError
    with the reason, before anything collective happens."""
    quant = parse_quant(quant)
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"tpcomm: FP8 quantization takes {', '.join(map(str, INPUT_DTYPES))} inputs, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"tpcomm: FP8 quantization needs a non-empty last dimension, got shape {tuple(x.shape)}")
    if quant == Quant.PER_TENSOR:
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"tpcomm: per_tensor quantization needs a scale tensor (fp32, one element), got "
                            f"{type(scale).__name__}")
        if scale.dtype != torch.float32:
            raise TypeError(f"tpcomm: the per_tensor scale must be float32, got {scale.dtype}")
        if scale.numel() != 1:
            raise ValueError(f"tpcomm: the per_tensor scale must have one element, got shape {tuple(scale.shape)}")
        if scale.device != x.device:
            raise ValueError(f"tpcomm: the per_tensor scale is on {scale.device} but the input is on {x.device}")
        if column_major_scales:
            raise ValueError("tpcomm: column_major_scales applies to per_token and per_token_group scales; "
                             "per_tensor has one scale")
    elif scale is not None:
        raise ValueError(f"tpcomm: {quant.name.lower()} quantization computes its scales; it takes no scale")
    if quant == Quant.PER_TOKEN_GROUP and x.shape[-1] % GROUP:
        raise ValueError(f"tpcomm: per_token_group quantization needs a hidden size that is a multiple of {GROUP}, "
                         f"got {x.shape[-1]} (tpcomm declines it rather than pad)")
    if column_major_scales and x.dim() != 2:
        raise ValueError(f"tpcomm: column_major_scales needs a 2-D input (tokens, hidden), got shape "
                         f"{tuple(x.shape)}")
    return quant, check_floor(quant, floor)


def scales_shape(shape, quant):
    """The shape of the scales of an input of `shape` (not PER_TENSOR's (1,))."""
    return tuple(shape[:-1]) + ((1,) if quant == Quant.PER_TOKEN else (shape[-1] // GROUP,))


def empty_scales(x, quant, column_major_scales=False):
    """Uninitialised fp32 scales for x in the mode's layout: row-major
    x.shape[:-1] + (groups,), or with column_major_scales (2-D x) shape
    (M, groups) with strides (1, M), what DeepGEMM reads."""
    shape = scales_shape(x.shape, quant)
    if column_major_scales:
        return torch.empty(shape[::-1], dtype=torch.float32, device=x.device).t()
    return torch.empty(shape, dtype=torch.float32, device=x.device)


def empty_outputs(x, quant, scale=None, column_major_scales=False):
    """(codes, scales) to write: codes e4m3 of x's shape, contiguous; scales
    empty_scales(), or for PER_TENSOR an fp32 copy of `scale` of shape (1,)
    (the kernel reads it)."""
    codes = torch.empty(x.shape, dtype=DTYPE, device=x.device)
    if quant == Quant.PER_TENSOR:
        return codes, scale.detach().reshape(1).clone()
    return codes, empty_scales(x, quant, column_major_scales)


def e4m3(v):
    """fp32 v to e4m3: round to nearest even, saturating to +-448; NaN stays NaN."""
    return v.clamp(-FP8_MAX, FP8_MAX).to(DTYPE)


def _dynamic_scales(a, floor):
    """amax / 448 in fp32, floored (a NaN amax stays NaN). The divisor is a
    tensor: torch divides by a Python number on CUDA as a product with its
    reciprocal (another rounding, 1 ulp off in about half the cases), on the
    CPU as a division; a tensor divisor divides on both, as the kernel does."""
    s = a / torch.full_like(a, FP8_MAX)
    return torch.where(s < floor, torch.full_like(s, floor), s)


def quantize(x16, quant, scale=None, floor=None, column_major_scales=False):
    """(codes, scales) of x16 (the normed output in its dtype) by the module's
    math: codes e4m3 of x16's shape, contiguous; scales fp32 in the mode's
    layout (empty_outputs)."""
    quant, floor = check_args(quant, x16, scale, floor, column_major_scales)
    return quantize_checked(x16, quant, scale, floor, column_major_scales)


def quantize_checked(x16, quant, scale, floor, column_major_scales):
    """quantize() of arguments check_args() passed: quant a Quant, floor its fp32 floor."""
    x = x16.float()
    codes, scales = empty_outputs(x16, quant, scale, column_major_scales)
    if quant == Quant.PER_TENSOR:
        codes.copy_(e4m3(x / scales.reshape(())))
        return codes, scales
    if quant == Quant.PER_TOKEN:
        s = _dynamic_scales(x.abs().amax(-1, keepdim=True), floor)
        codes.copy_(e4m3(x / s))
    else:
        groups = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
        s = _dynamic_scales(groups.abs().amax(-1), floor)
        codes.copy_(e4m3(groups / s.unsqueeze(-1)).view(x.shape))
    scales.copy_(s)
    return codes, scales
