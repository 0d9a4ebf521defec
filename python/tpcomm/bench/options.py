"""The run's command-line lists read into what it measures: sizes per rank,
hidden sizes, dtypes, choices from the vocabulary, and each op's input
shapes. Each raises ValueError on what it cannot read."""
from .vocabulary import DTYPE_ALIASES, NORM_OPS


def size_list(lo, hi, step=4):
    """lo, lo*step, lo*step**2, ... up to hi; hi itself is appended when the
    steps miss it. 64 B .. 64 MiB with step 4: 64, 256, 1 KiB, ..., 64 MiB."""
    lo, hi, step = int(lo), int(hi), int(step)
    if lo <= 0 or hi < lo:
        raise ValueError(f"sizes need 0 < min ({lo}) <= max ({hi})")
    if step < 2:
        raise ValueError(f"size step must be at least 2, got {step}")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= step
    if out[-1] != hi:
        out.append(hi)
    return out


def parse_hidden(text):
    """'4096,8192' -> [4096, 8192]; raises ValueError unless positive integers."""
    try:
        out = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or min(out) <= 0:
        raise ValueError(f"hidden sizes must be positive integers, comma-separated; got {text!r}")
    return list(dict.fromkeys(out))


def shapes(op, itemsize, sizes, world, hiddens):
    """The input shapes of `op` for the requested sizes per rank, each once:
    (numel,) for the collectives (reduce_scatter: `world` equal parts);
    (tokens, hidden) for the norm ops, tokens = size // row, at least 1."""
    out = []
    for req in sizes:
        if op in NORM_OPS:
            out += [(max(1, req // (h * itemsize)), h) for h in hiddens]
            continue
        numel = max(1, req // itemsize)
        out.append((max(world, numel // world * world),) if op == "reduce_scatter" else (numel,))
    return list(dict.fromkeys(out))


def parse_dtypes(text):
    """'bf16,fp32' -> ['bfloat16', 'float32']; raises ValueError on unknown names."""
    out = []
    for name in (t.strip().lower() for t in text.split(",")):
        if not name:
            continue
        if name not in DTYPE_ALIASES:
            raise ValueError(f"unknown dtype {name!r} (choose from {', '.join(sorted(DTYPE_ALIASES))})")
        if DTYPE_ALIASES[name] not in out:
            out.append(DTYPE_ALIASES[name])
    if not out:
        raise ValueError("no dtype given")
    return out


def parse_choices(text, allowed, what):
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {', '.join(bad)} (choose from {', '.join(allowed)})")
    if not out:
        raise ValueError(f"no {what} given")
    return list(dict.fromkeys(out))
