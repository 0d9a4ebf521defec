"""The four kinds of data the quantized all-reduce is checked on (CPU tests
of tpcomm.quantized_reference, GPU tests of the kernel): every rank's input
drawn from one seed, so each rank can compute the reference of the whole
group. A helper module, not a test module."""
import torch

KINDS = ("uniform", "student_t", "outlier", "zero")


def inputs(kind, world, numel, dtype, seed=0):
    """The `world` ranks' inputs (CPU tensors of `dtype`): uniform in
    [-1, 1); Student-t with 3 degrees of freedom (heavy tails); normal with
    the group of values 64..95 a hundred times larger (within fp16's range
    summed over 8 ranks); all zero."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        xs = [torch.rand(numel, generator=g) * 2 - 1 for _ in range(world)]
    elif kind == "student_t":  # normal / sqrt(chi2 / df), df = 3
        xs = []
        for _ in range(world):
            chi2 = (torch.randn(3, numel, generator=g) ** 2).sum(0)
            xs.append(torch.randn(numel, generator=g) / (chi2 / 3).sqrt())
    elif kind == "outlier":
        xs = [torch.randn(numel, generator=g) for _ in range(world)]
        for x in xs:
            x[64:96] *= 100
    elif kind == "zero":
        xs = [torch.zeros(numel) for _ in range(world)]
    else:
        raise ValueError(f"no data kind {kind!r} (kinds: {KINDS})")
    return [x.to(dtype) for x in xs]
