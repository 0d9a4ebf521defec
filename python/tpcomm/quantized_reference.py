"""The quantized all-reduce (csrc/kernels/all_reduce_quant.cuh) in torch (on
the inputs' device: the CPU in tests, the GPU in tpcomm.bench's check):
`emulate` gives the kernel's bits, `bound` the error docs/design.md derives,
per element, against the exact (fp64) sum. Tests hold the kernel to both.

Groups are the GROUP (TPC_QUANT_GROUP, 32) consecutive values from every
multiple of GROUP of the flattened input (the last one zero-padded). Rank o owns the units (8 values)
[o*C, (o+1)*C), C = ceil(units / n) rounded up to 4 units (one group), and
sums its groups in fp32, in rank order from -0.0: its own values as they
are, every peer's decoded. The sums are quantized again and every rank,
the owner too, decodes those codes and rounds once to the dtype.

A group with absmax A (NaN-propagating) travels as codes against the scale
s = A / qmax (fp32, rounded): code = round(clamp(v * (qmax / A), +-qmax))
(to nearest even; fp8: e4m3, which saturates at 448), decoded as code * s,
each step one IEEE fp32 rounding. A NaN or +-inf in a group: scale NaN, so
the group decodes to NaN (and so does every sum it enters). A < 2^-64: the
group decodes to 0."""
import torch

from . import _constants as C

QMAX = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}
MODES = tuple(QMAX)
GROUP = C.TPC_QUANT_GROUP  # values of a group
GROUP_UNITS = GROUP // 8   # 16-byte units of a 16-bit dtype in a group (TPC_QUANT_LANES)
TINY = 2.0 ** -64
# The per-value error of a group's codes is at most COEFFICIENT[mode] * A
# (+ min(A, 2^-64) for the groups that decode to 0): half a step, A / (2 qmax),
# for the integers; half an e4m3 ulp, 2^-4 |y| (plus the subnormals' 2^-10 s),
# for fp8; and the fp32 roundings of the scale, the multiplier, the product
# and the decode (docs/design.md).
COEFFICIENT = {"fp8": 2.0 ** -4 + 2.0 ** -18, "int8": 1 / 254 + 2.0 ** -21, "int4": 1 / 14 + 2.0 ** -21}
# Rounding to the dtype: relative half ulp and half the smallest subnormal.
DTYPE_ROUNDING = {torch.bfloat16: (2.0 ** -8, 2.0 ** -134), torch.float16: (2.0 ** -11, 2.0 ** -25)}


def chunk_units(units, world):
    """C: the 16-byte units of each rank's chunk (whole groups)."""
    per_rank = -(-units // world)
    return -(-per_rank // GROUP_UNITS) * GROUP_UNITS


def _groups(inputs):
    """(n, groups, GROUP) fp32 values of the ranks' inputs, zero-padded, and
    the number of values."""
    numel = inputs[0].numel()
    flat = torch.stack([t.reshape(-1).float() for t in inputs])
    pad = (-numel) % GROUP
    if pad:
        flat = torch.cat([flat, flat.new_zeros(len(inputs), pad)], 1)
    return flat.reshape(len(inputs), -1, GROUP), numel


def _owners(groups, units, world, device):
    """The rank that owns each group."""
    return torch.arange(groups, device=device) * GROUP_UNITS // chunk_units(units, world)


def decode(values, mode):
    """What a group's codes decode to, for fp32 values grouped in the last
    dimension (GROUP each), with the kernel's rounding at every step."""
    qmax = torch.tensor(QMAX[mode], dtype=torch.float32, device=values.device)
    absmax = values.abs().amax(-1, keepdim=True)
    finite = torch.isfinite(absmax)
    normal = finite & (absmax >= TINY)
    scale = torch.where(normal, absmax / qmax, torch.zeros(()))
    scale = torch.where(finite, scale, torch.full((), float("nan")))
    inv = torch.where(normal, qmax / torch.where(normal, absmax, torch.ones(())), torch.zeros(()))
    y = values * inv
    y = torch.where(torch.isnan(y), torch.zeros(()), y.clamp(-qmax, qmax))
    if mode == "fp8":
        code = y.to(torch.float8_e4m3fn).to(torch.float32)
    else:
        code = torch.round(y).to(torch.int32).to(torch.float32)
    return code * scale


def emulate(inputs, mode):
    """The kernel's output, bit for bit, for the ranks' inputs (a list of
    same-shaped float16 or bfloat16 tensors, whose byte size is a multiple
    of 16)."""
    if mode not in QMAX:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    dtype, shape, n = inputs[0].dtype, inputs[0].shape, len(inputs)
    x, numel = _groups(inputs)
    owner = _owners(x.shape[1], numel // 8, n, x.device)[:, None]
    coded = decode(x, mode)
    acc = torch.full(x.shape[1:], -0.0, device=x.device)
    for q in range(n):
        acc = acc + torch.where(owner == q, x[q], coded[q])
    out = decode(acc, mode)
    return out.reshape(-1)[:numel].to(dtype).reshape(shape)


def code_error(absmax, mode):
    """The bound on one value's error once its group (absmax A) is coded."""
    return COEFFICIENT[mode] * absmax + absmax.clamp(max=TINY)


def bound(inputs, mode):
    """(bound, exact): per element, the largest |kernel - exact sum| the derivation allows
    (fp64), for finite inputs whose sum stays in the dtype's range:
      E1 = sum over the peers q of the owner of e(A_q)  (their codes)
      E2 = (n - 1) 2^-24 sum over q of (A_q + e(A_q))  (fp32 sums)
      E3 = e(S), S = max |exact| over the group + E1 + E2  (the sums' codes)
      total = E1 + E2 + E3 + u (|exact| + E1 + E2 + E3) + eta  (the dtype)
    with e(A) = COEFFICIENT * A + min(A, 2^-64) and u, eta the dtype's
    relative and subnormal half ulps."""
    dtype, shape, n = inputs[0].dtype, inputs[0].shape, len(inputs)
    x, numel = _groups(inputs)
    x = x.double()
    owner = _owners(x.shape[1], numel // 8, n, x.device)[:, None]
    exact = x.sum(0)
    absmax = x.abs().amax(-1, keepdim=True)  # (n, groups, 1)
    err = code_error(absmax, mode)
    peers = torch.stack([torch.where(owner == q, torch.zeros((), dtype=err.dtype, device=err.device), err[q])
                         for q in range(n)])
    e1 = peers.sum(0)
    e2 = (n - 1) * 2.0 ** -24 * (1 + 2.0 ** -20) * (absmax + err).sum(0)  # (1 + 2^-24)^(n-1) < 1 + 2^-20
    s = exact.abs().amax(-1, keepdim=True) + e1 + e2
    e3 = code_error(s, mode)
    u, eta = DTYPE_ROUNDING[dtype]
    total = e1 + e2 + e3 + u * (exact.abs() + e1 + e2 + e3) + eta
    return total.expand_as(exact).reshape(-1)[:numel].reshape(shape), exact.reshape(-1)[:numel].reshape(shape)
