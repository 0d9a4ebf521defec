"""Per-rank test data whose sums are exact, and bit-for-bit comparison (CPU
and GPU tests). A helper module, not a test module."""
import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def exact_values(rank, shape, dtype, seed=0):
    """Rank-dependent values whose sums over up to 8 ranks are exact in
    `dtype` in any order (so no summation order can change a bit)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype in (torch.float16, torch.bfloat16):
        return torch.randint(-8, 9, shape, generator=g).to(dtype)
    if dtype.is_floating_point:
        return (torch.randint(-4000, 4001, shape, generator=g).to(torch.float64) / 4).to(dtype)
    return torch.randint(-10**12, 10**12, shape, generator=g, dtype=torch.int64).to(dtype)


def expected_sum(world_size, shape, dtype, seed=0, ranks=None):
    """The sum of exact_values over `ranks` (default: all), in dtype."""
    ranks = range(world_size) if ranks is None else ranks
    total = torch.zeros(shape, dtype=torch.float64 if dtype.is_floating_point else torch.int64)
    for r in ranks:
        total += exact_values(r, shape, dtype, seed).to(total.dtype)
    return total.to(dtype)


def bits(t):
    """t's elements as integers of the same width (a copy when t is not
    contiguous): equal bits, equal integers, NaN payloads and -0.0 included."""
    t = t.contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_INT_OF_WIDTH[t.element_size()])


def assert_bits_equal(actual, expected, what):
    """actual has expected's dtype, shape and bits, element for element."""
    assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}, not a tensor"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    a, e = bits(actual).flatten(), bits(expected.to(actual.device)).flatten()
    if not torch.equal(a, e):
        bad = (a != e).nonzero().flatten()
        first = bad[:4].tolist()
        raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} elements differ, first at flat index {first}: "
                             f"{actual.flatten()[first].tolist()} vs {expected.flatten()[first].tolist()}")
