"""Property tests of tpcomm.Communicator's public API on CPU tensors.

A Communicator on a gloo group with device="cpu" is disabled, so every call
goes to torch.distributed. These tests draw random calls with hypothesis
(shapes of 0-4 dims with 0..9 elements per dim, zero-size tensors included;
every dtype the op takes; negative and out-of-range dims; non-contiguous
views: permutations, step slices, storage offsets, expand/broadcast views;
tensors on "meta"; right and wrong `out=` tensors; objects that are not
tensors) and pin down, for every call, exactly one of:

* it returns the answer computed here independently of tpcomm and of the
  collective (every rank rebuilds every rank's input from the example's
  seed), compared bit for bit, with the input left unchanged; or
* it raises the documented exception type, with the documented words in its
  message, before communicating, leaving its tensor arguments unchanged.

Never a hang (the group's and the harness's timeouts turn one into a
failure), a crash, or a wrong answer.

Lock step. Every rank runs the same hypothesis test with derandomize=True, so
all ranks draw the same examples in the same order and call the collectives
in step. Each example is also fenced by two small collectives of its own:
before the call the ranks compare the example's description (a divergence
fails at once as "ranks out of step" instead of pairing different
collectives), and after it they exchange their verdicts, so a failure on one
rank fails the example on every rank, and hypothesis shrinks and replays it
on all ranks together.
"""
import gc
import math
import traceback
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import tpcomm

from multiproc import run_ranks

from tpcomm.errors import CommunicatorClosed

# Both ranks must draw identical examples: derandomized, no example database,
# no time-dependent health checks or deadlines, no "explain" phase (it only
# adds reruns after a failure).
PHASES = (Phase.explicit, Phase.generate, Phase.shrink)


def _settings(max_examples):
    return settings(derandomize=True, max_examples=max_examples, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), phases=PHASES, print_blob=False)


# Generous: a passing run takes seconds; a failing one shrinks its example in
# lock step on every rank, which takes longer. A hang still fails: the gloo
# group's own 60 s timeout raises in the waiting rank first.
RUN_TIMEOUT_S = 240

EXAMPLES_2 = 300  # per property on 2 ranks
EXAMPLES_3 = 100  # per property on 3 ranks
EXAMPLES_CLOSED = 60

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "int8": torch.int8, "bool": torch.bool,
}
# Both ops take every dtype. One caveat for all_reduce of bool: gloo "sums"
# bool tensors by adding their bytes, so on 2 ranks True + True comes back as
# a bool whose byte is 2 (3 on 3 ranks), not the canonical 1. torch reads
# such a byte as True (==, torch.equal, .sum(), .to() all do), so the answer
# is right as a logical OR, but not bit for bit; all_reduce results of bool
# are therefore compared after normalising them (_canonical), everything
# else bit for bit.

# Objects that are not tensors, by a label (the label, not the object, is in
# the example, so every rank describes the example the same way).
NON_TENSORS = {
    "None": lambda: None,
    "int": lambda: 3,
    "float": lambda: 2.5,
    "bool": lambda: True,
    "str": lambda: "tensor",
    "list": lambda: [1.0, 2.0],
    "nested_list": lambda: [[1, 2], [3, 4]],
    "tuple": lambda: (1, 2),
    "dict": lambda: {"x": torch.ones(2)},
    "object": lambda: object(),
    "torch.Size": lambda: torch.Size([2, 3]),
    "torch.dtype": lambda: torch.float32,
    "numpy": lambda: np.ones((2, 3), dtype=np.float32),
    "numpy_scalar": lambda: np.float32(1.5),
}


# ------------------------------------------------------------ example data

def _values(seed, rank, salt, shape, dtype):
    """Rank-dependent values whose sums over up to 3 ranks are exact in
    `dtype`, whatever the order of summation: multiples of 1/4 below 1000 in
    fp32/fp64, small integers in fp16/bf16, with some -0.0 (the sum of zeros
    is -0.0 exactly when every term is -0.0, in any order); integers that
    cannot overflow a signed sum; uint8 over its whole range (its sum wraps
    modulo 256, in any order)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + rank * 7_919 + salt * 104_729) % 2**63)
    if dtype.is_floating_point:
        if dtype in (torch.float16, torch.bfloat16):
            v = torch.randint(-8, 9, shape, generator=g).to(torch.float64)
        else:
            v = torch.randint(-4000, 4001, shape, generator=g).to(torch.float64) / 4
        negzero = torch.randint(0, 5, shape, generator=g) == 0
        v = torch.where(negzero, torch.full_like(v, -0.0), v)
        return v.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    lo, hi = {torch.int64: (-2**60, 2**60), torch.int32: (-2**29, 2**29),
              torch.int8: (-40, 41), torch.uint8: (0, 256)}[dtype]
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def _lay_out(values, layout, make_values):
    """A tensor with `values`' shape, dtype and logical values, laid out as
    `layout` says (a dict, see _layouts). `make_values(shape)` gives values of
    another shape (for expand, whose logical values repeat)."""
    kind = layout["kind"]
    shape = tuple(values.shape)
    if kind == "contiguous":
        return values.clone()
    if kind == "offset":  # contiguous, at a storage offset (a misaligned address)
        k = layout["k"]
        storage = torch.zeros(values.numel() + k + 1, dtype=values.dtype)
        x = storage[k:k + values.numel()].view(shape)
        return x.copy_(values)
    if kind == "permute":  # a transposed / permuted view
        perm = layout["perm"]
        inverse = [perm.index(i) for i in range(len(perm))]
        return values.permute(perm).contiguous().permute(inverse)
    if kind == "step":  # step slices of a larger tensor, at an offset
        steps, offsets = layout["steps"], layout["offsets"]
        buf = torch.zeros([s * k + 1 for s, k in zip(shape, steps)], dtype=values.dtype)
        x = buf[tuple(slice(o, o + s * k, k) for s, k, o in zip(shape, steps, offsets))]
        assert tuple(x.shape) == shape
        return x.copy_(values)
    if kind == "expand":  # a broadcast view: stride 0 along the expanded dims
        lead, ones = layout["lead"], layout["ones"]
        small = [1 if one else s for s, one in zip(shape[lead:], ones)]
        return make_values(small).expand(shape)
    raise AssertionError(kind)


NONCONTIGUOUS = ("permute", "step", "expand")


@st.composite
def _layouts(draw, ndim, kinds=("contiguous", "offset") + NONCONTIGUOUS):
    """A layout (see _lay_out) for a tensor of ndim dims; a 0-dim tensor is
    contiguous or at an offset, whatever `kinds` says."""
    kinds = [k for k in kinds if ndim or k not in NONCONTIGUOUS] or ["contiguous"]
    kind = draw(st.sampled_from(kinds))
    if kind == "offset":
        return {"kind": kind, "k": draw(st.integers(1, 3))}
    if kind == "permute":
        return {"kind": kind, "perm": draw(st.permutations(range(ndim)))}
    if kind == "step":
        return {"kind": kind, "steps": draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim)),
                "offsets": draw(st.lists(st.integers(0, 1), min_size=ndim, max_size=ndim))}
    if kind == "expand":
        lead = draw(st.integers(0, ndim))
        return {"kind": kind, "lead": lead,
                "ones": draw(st.lists(st.booleans(), min_size=ndim - lead, max_size=ndim - lead))}
    return {"kind": kind}


# sampled_from, not integers(): hypothesis draws integers() near their lower
# bound far more often (a third of the shapes would be 0-dim).
_shapes = st.sampled_from(range(5)).flatmap(
    lambda ndim: st.lists(st.sampled_from(range(10)), min_size=ndim, max_size=ndim)).map(tuple)


def _one_in(n):
    """True about once in n draws (and False when shrunk)."""
    return st.sampled_from([False] * (n - 1) + [True])


@st.composite
def _inputs(draw, dtypes=tuple(DTYPES)):
    """The description of one rank-dependent input: a non-tensor, or a tensor
    of some shape, dtype, layout and device."""
    if draw(_one_in(20)):
        return {"non_tensor": draw(st.sampled_from(sorted(NON_TENSORS)))}
    shape = draw(_shapes)
    return {"shape": shape, "dtype": draw(st.sampled_from(dtypes)),
            "layout": draw(_layouts(len(shape))),
            "device": "meta" if draw(_one_in(12)) else "cpu"}


def _build(spec, seed, rank, salt=0):
    """The object `spec` describes, as rank `rank` holds it in example `seed`."""
    if "non_tensor" in spec:
        return NON_TENSORS[spec["non_tensor"]]()
    dtype = DTYPES[spec["dtype"]]

    def make_values(shape):
        return _values(seed, rank, salt, tuple(shape), dtype)

    x = _lay_out(make_values(spec["shape"]), spec["layout"], make_values)
    if spec["device"] == "meta":
        x = torch.empty_strided(x.shape, x.stride(), dtype=dtype, device="meta")
    return x


# ------------------------------------------------------ oracles and checks

def _bits(t):
    """t's bit patterns, as integers: -0.0 differs from 0.0, NaNs by payload."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _assert_bits(actual, expected, what):
    assert isinstance(actual, torch.Tensor), f"{what}: returned {type(actual).__name__}, not a tensor"
    assert actual.device == expected.device, (what, actual.device, expected.device)
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, tuple(actual.shape), tuple(expected.shape))
    differ = _bits(actual) != _bits(expected)
    if differ.any():
        where = tuple(i.item() for i in differ.nonzero()[0])
        raise AssertionError(f"{what}: {differ.sum().item()} of {differ.numel()} elements differ, the first at "
                             f"{where}: got {actual[where].item()!r}, expected {expected[where].item()!r}"
                             f"\n  got      {actual}\n  expected {expected}")


def _canonical(t):
    """t, with bool bytes other than 0 and 1 normalised to 1 (see DTYPES)."""
    return t.to(torch.uint8).to(torch.bool) if isinstance(t, torch.Tensor) and t.dtype == torch.bool else t


def _snapshot(obj):
    """A copy of a CPU tensor's logical values (to check it was left alone)."""
    if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
        return obj.clone()
    return None


def _exact_sum(parts):
    """The sum of every rank's logical values, exact (see _values), in the
    parts' dtype: float sums in float64 (exact here), integer sums in int64
    (no overflow here), wrapped modulo 256 for uint8; for bool, the logical
    OR."""
    dtype = parts[0].dtype
    if dtype == torch.bool:
        acc = parts[0].clone()
        for p in parts[1:]:
            acc |= p
        return acc
    if dtype.is_floating_point:
        acc = parts[0].to(torch.float64).clone()  # not 0.0 + ...: that would turn -0.0 into 0.0
        for p in parts[1:]:
            acc += p.to(torch.float64)
        return acc.to(dtype)
    acc = torch.zeros(parts[0].shape, dtype=torch.int64)
    for p in parts:
        acc += p.to(torch.int64)
    if dtype == torch.uint8:
        acc = acc % 256
    return acc.to(dtype)


def _raises_one_of(call, allowed, what):
    """call() must raise an exception that is an instance of one of the
    `allowed` (type, words) pairs, with those words in its message."""
    try:
        result = call()
    except Exception as e:  # noqa: BLE001 - judged below
        for etype, words in allowed:
            if isinstance(e, etype) and words in str(e):
                return e
        raise AssertionError(f"{what}: expected one of {_fmt(allowed)}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"{what}: expected one of {_fmt(allowed)}, but it returned "
                         f"{type(result).__name__} {getattr(result, 'shape', '')}")


def _fmt(allowed):
    return ", ".join(f"{t.__name__}({w!r})" for t, w in allowed)


def _in_step(key, check):
    """Runs check() on every rank for the example described by `key` (a
    string, the same on every rank), and fails on every rank if it failed on
    any; see the module docstring."""
    world_size = dist.get_world_size()
    keys = [None] * world_size
    dist.all_gather_object(keys, key)
    if len(set(keys)) != 1:
        raise AssertionError("ranks out of step:\n" + "\n".join(f"  rank {r}: {k}" for r, k in enumerate(keys)))
    try:
        check()
        verdict = None
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        verdict = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    verdicts = [None] * world_size
    dist.all_gather_object(verdicts, verdict)
    failed = [f"--- rank {r}: {v}" for r, v in enumerate(verdicts) if v is not None]
    if failed:
        raise AssertionError(f"example {key} failed:\n" + "\n".join(failed))


# ------------------------------------------------------------- all_reduce

@st.composite
def _all_reduce_cases(draw):
    """x (see _inputs) and one of the kinds of out=."""
    x = draw(_inputs(list(DTYPES)))
    kinds = ["none", "non_tensor"] + (["self", "fresh", "fresh_offset", "alias", "wrong_shape", "wrong_dtype",
                                      "noncontig", "meta"] if "shape" in x else [])
    kind = draw(st.sampled_from(kinds))
    out = {"kind": kind}
    if kind == "non_tensor":
        out["what"] = draw(st.sampled_from(sorted(set(NON_TENSORS) - {"None"})))
    elif kind == "wrong_shape":
        shape = x["shape"]
        candidates = [shape + (1,), (1,) + shape, (math.prod(shape),), shape[::-1], shape[1:], shape[:-1],
                      tuple(s + 1 for s in shape), draw(_shapes)]
        out["shape"] = draw(st.sampled_from([c for c in candidates if c != shape] or [shape + (2,)]))
    elif kind == "wrong_dtype":
        out["dtype"] = draw(st.sampled_from([d for d in DTYPES if d != x["dtype"]]))
    elif kind == "noncontig":
        out["layout"] = draw(_layouts(len(x["shape"]), NONCONTIGUOUS))
    return {"seed": draw(st.integers(0, 2**20)), "x": x, "out": out}


def _build_out(case, x, rank):
    """The out= argument of this case (rank-dependent garbage where it is a
    fresh tensor: it must be overwritten)."""
    out, spec, seed = case["out"], case["x"], case["seed"]
    kind = out["kind"]
    if kind == "none":
        return None
    if kind == "non_tensor":
        return NON_TENSORS[out["what"]]()
    if kind == "self":
        return x
    if kind == "alias":  # a second tensor object over x's memory, where x allows one
        return x.view(x.shape) if x.is_contiguous() else x.as_strided(x.shape, x.stride())
    fresh = dict(spec, layout={"kind": "contiguous"})
    if kind == "fresh_offset":
        fresh["layout"] = {"kind": "offset", "k": 1}
    elif kind == "wrong_shape":
        fresh["shape"] = out["shape"]
    elif kind == "wrong_dtype":
        fresh["dtype"] = out["dtype"]
    elif kind == "noncontig":
        fresh["layout"] = out["layout"]
    elif kind == "meta":
        fresh["device"] = "meta"
    return _build(fresh, seed, rank, salt=1)


def _all_reduce_errors(x, out):
    """The errors all_reduce(x, out=out) may raise (any one of them, when
    several apply: the order of the checks is not pinned); [] if it must
    succeed."""
    errors = []
    for what, t in (("input", x), ("out", out)):
        if t is None and what == "out":
            continue
        if not isinstance(t, torch.Tensor):
            errors.append((TypeError, "torch.Tensor"))
        elif t.device.type != "cpu":
            errors.append((ValueError, t.device.type))
    if isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor):
        if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
            errors.append((ValueError, "shape and dtype"))
    return errors


def _check_all_reduce(comm, case, rank, world_size):
    x = _build(case["x"], case["seed"], rank)
    out = _build_out(case, x, rank)
    x_before, out_before = _snapshot(x), _snapshot(out)
    errors = _all_reduce_errors(x, out)
    if errors:
        _raises_one_of(lambda: comm.all_reduce(x, out=out), errors, "all_reduce")
        if x_before is not None:
            _assert_bits(x, x_before, "all_reduce that raised changed its input")
        if out_before is not None:
            _assert_bits(out, out_before, "all_reduce that raised changed out")
        return
    parts = [_build(case["x"], case["seed"], r).contiguous() for r in range(world_size)]
    expected = _exact_sum(parts)
    y = comm.all_reduce(x) if case["out"]["kind"] == "none" else comm.all_reduce(x, out=out)
    _assert_bits(_canonical(y), expected, "all_reduce result")
    if out is None:
        if x.numel():
            assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), \
                "all_reduce without out= returned a tensor over its input's memory"
        _assert_bits(x, x_before, "all_reduce without out= changed its input")
    else:
        assert y is out, "all_reduce(out=...) did not return out itself"
        if case["out"]["kind"] in ("self", "alias"):
            _assert_bits(_canonical(x), expected, "all_reduce in place: x")
        else:
            _assert_bits(x, x_before, "all_reduce with out= changed its input")


_EXAMPLE_LAYOUTS = [{"kind": "contiguous"}, {"kind": "offset", "k": 2}, {"kind": "permute", "perm": [2, 0, 1]},
                    {"kind": "step", "steps": [2, 1, 3], "offsets": [1, 0, 1]},
                    {"kind": "expand", "lead": 1, "ones": [True, False]}]


def _all_reduce_examples():
    """Explicit examples, run first: every dtype with every kind of valid
    out= and layout, zero-size and 0-dim tensors, every non-tensor as x and
    as out (random generation visits some of these rarely)."""
    cases = []
    outs = ["none", "self", "fresh", "fresh_offset", "alias"]
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate([(3, 4, 5), (0, 4, 5), ()]):
            layout = _EXAMPLE_LAYOUTS[(i + j) % len(_EXAMPLE_LAYOUTS)] if shape else {"kind": "contiguous"}
            x = {"shape": shape, "dtype": dtype, "layout": layout, "device": "cpu"}
            cases.append({"seed": 10 * i + j, "x": x, "out": {"kind": outs[(i + j) % len(outs)]}})
    x = {"shape": (2, 8), "dtype": "float32", "layout": {"kind": "contiguous"}, "device": "cpu"}
    for label in sorted(NON_TENSORS):
        cases.append({"seed": 1, "x": {"non_tensor": label}, "out": {"kind": "none"}})
        if label != "None":
            cases.append({"seed": 2, "x": x, "out": {"kind": "non_tensor", "what": label}})
    return cases


def _assert_ran(ran, expected):
    """Every example ran (a property that silently checks nothing is no test)."""
    assert len(ran) >= expected, f"only {len(ran)} of {expected} examples ran"


def _with_examples(test, cases):
    for case in reversed(cases):  # example() decorators run bottom-up
        test = example(case=case)(test)
    return test


def _run_property(comm, rank, world_size, max_examples, cases, explicit, check):
    """Runs check(comm, case, rank, world_size) in step on every rank over
    `explicit` and then max_examples cases drawn from the `cases` strategy."""
    ran = []

    @_settings(max_examples)
    @given(case=cases)
    def prop(case):
        _in_step(repr(case), lambda: check(comm, case, rank, world_size))
        ran.append(case)

    _with_examples(prop, explicit)()
    _assert_ran(ran, len(explicit) + max_examples)


def _all_reduce_property(comm, rank, world_size, max_examples):
    _run_property(comm, rank, world_size, max_examples, _all_reduce_cases(), _all_reduce_examples(),
                  _check_all_reduce)


# -------------------------------------------------------------- all_gather

@st.composite
def _all_gather_cases(draw):
    """x (see _inputs, every dtype) and a dim in -(ndim + 2)..ndim + 1, or far
    out of range, or the default."""
    x = draw(_inputs(list(DTYPES)))
    ndim = len(x.get("shape", (0,)))
    kind = draw(st.sampled_from(["in range"] * 4 + ["default", "just out", "far out"]))
    if kind == "default":
        dim = None
    elif kind == "in range":
        dim = draw(st.sampled_from(range(-ndim, ndim) if ndim else [0, -1]))
    elif kind == "just out":
        dim = draw(st.sampled_from([ndim, ndim + 1, -ndim - 1, -ndim - 2]))
    else:
        dim = draw(st.sampled_from([100, -100, 2**31, -2**63]))
    return {"seed": draw(st.integers(0, 2**20)), "x": x, "dim": dim}


def _all_gather_errors(x, dim):
    if not isinstance(x, torch.Tensor):
        return [(TypeError, "torch.Tensor")]
    errors = []
    if x.device.type != "cpu":
        errors.append((ValueError, x.device.type))
    if x.dim() == 0:
        errors.append((ValueError, "at least one dimension"))
    elif not -x.dim() <= dim < x.dim():
        errors.append((IndexError, "out of range"))
    return errors


def _check_all_gather(comm, case, rank, world_size):
    x = _build(case["x"], case["seed"], rank)
    dim = 0 if case["dim"] is None else case["dim"]
    call = (lambda: comm.all_gather(x)) if case["dim"] is None else (lambda: comm.all_gather(x, dim=dim))
    x_before = _snapshot(x)
    errors = _all_gather_errors(x, dim)
    if errors:
        _raises_one_of(call, errors, f"all_gather(dim={dim})")
        if x_before is not None:
            _assert_bits(x, x_before, "all_gather that raised changed its input")
        return
    parts = [_build(case["x"], case["seed"], r).contiguous() for r in range(world_size)]
    y = call()
    _assert_bits(y, torch.cat(parts, dim), f"all_gather(dim={dim}) result")
    assert y.is_contiguous(), f"all_gather result is not contiguous: strides {y.stride()}"
    if x.numel():
        assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), \
            "all_gather returned a tensor over its input's memory"
    _assert_bits(x, x_before, "all_gather changed its input")


def _all_gather_examples():
    """Explicit examples, run first: every dtype with every layout and every
    in-range dim, zero-size tensors, 0-dim tensors, every non-tensor."""
    cases = []
    for i, dtype in enumerate(DTYPES):
        for j, dim in enumerate([0, 1, 2, -1, -2, -3]):
            layout = _EXAMPLE_LAYOUTS[(i + j) % len(_EXAMPLE_LAYOUTS)]
            shape = (3, 0, 5) if j == 5 else (3, 4, 5)
            cases.append({"seed": 10 * i + j, "x": {"shape": shape, "dtype": dtype, "layout": layout, "device": "cpu"},
                          "dim": dim})
        cases.append({"seed": i, "x": {"shape": (), "dtype": dtype, "layout": {"kind": "contiguous"}, "device": "cpu"},
                      "dim": None})
    for label in sorted(NON_TENSORS):
        cases.append({"seed": 1, "x": {"non_tensor": label}, "dim": 0})
    return cases


def _all_gather_property(comm, rank, world_size, max_examples):
    _run_property(comm, rank, world_size, max_examples, _all_gather_cases(), _all_gather_examples(),
                  _check_all_gather)


# ------------------------------------------------------ closed communicator

@st.composite
def _closed_cases(draw):
    op = draw(st.sampled_from(["all_reduce", "all_reduce_out", "all_gather"]))
    return {"seed": draw(st.integers(0, 2**20)), "op": op, "x": draw(_inputs(list(DTYPES))),
            "dim": draw(st.integers(-5, 5))}


def _check_closed(comm, case, rank):
    """On a closed communicator: a call with valid arguments raises
    CommunicatorClosed (a RuntimeError mentioning "closed"); one with invalid
    arguments raises that or the argument's own error; nothing communicates."""
    x = _build(case["x"], case["seed"], rank)
    op = case["op"]
    if op == "all_gather":
        call, errors = (lambda: comm.all_gather(x, dim=case["dim"])), _all_gather_errors(x, case["dim"])
    elif op == "all_reduce_out":
        call, errors = (lambda: comm.all_reduce(x, out=x)), _all_reduce_errors(x, x)
    else:
        call, errors = (lambda: comm.all_reduce(x)), _all_reduce_errors(x, None)
    x_before = _snapshot(x)
    _raises_one_of(call, [(CommunicatorClosed, "closed")] + errors, f"{op} after close()")
    if x_before is not None:
        _assert_bits(x, x_before, f"{op} after close() changed its input")


def _closed_property(comm, rank, max_examples):
    ran = []

    @_settings(max_examples)
    @given(case=_closed_cases())
    def prop(case):
        _check_closed(comm, case, rank)  # local: a closed communicator never communicates
        ran.append(case)

    prop()
    _assert_ran(ran, max_examples)


# ------------------------------------------------------------- rank bodies

def _with_communicator(rank, world_size, use):
    """Runs use(comm) on a fresh CPU Communicator of the world group, closes
    it, and then makes sure nothing references it any more (a failure is
    re-raised as an AssertionError holding its traceback's text).

    That last step matters to the harness, not to tpcomm's API: the
    Communicator holds the torch ProcessGroup, and a ProcessGroupGloo that is
    still referenced after destroy_process_group() (here: from the reference
    cycles hypothesis leaves behind, until the interpreter's final collection)
    aborts the process at exit now and then ("terminate called without an
    active exception", SIGABRT), with plain torch.distributed too."""
    comm = tpcomm.Communicator(device="cpu")
    assert comm.enabled is False and comm.disabled_reason, comm.disabled_reason
    assert (comm.rank, comm.world_size, comm.device) == (rank, world_size, torch.device("cpu"))
    ref = weakref.ref(comm)
    failure = None
    try:
        use(comm)
    except Exception:  # noqa: BLE001 - re-raised below as text, without the frames that hold comm
        failure = traceback.format_exc()
    comm.close()
    del comm
    gc.collect()
    if failure is not None:
        raise AssertionError(failure)
    assert ref() is None, f"the Communicator is still referenced by {gc.get_referrers(ref())}"


def _body_all_reduce(rank, world_size):
    _with_communicator(rank, world_size, lambda comm: _all_reduce_property(comm, rank, world_size, EXAMPLES_2))


def _body_all_gather(rank, world_size):
    _with_communicator(rank, world_size, lambda comm: _all_gather_property(comm, rank, world_size, EXAMPLES_2))


def _both_properties(comm, rank, world_size):
    _all_reduce_property(comm, rank, world_size, EXAMPLES_3)
    _all_gather_property(comm, rank, world_size, EXAMPLES_3)


def _body_three_ranks(rank, world_size):
    _with_communicator(rank, world_size, lambda comm: _both_properties(comm, rank, world_size))


def _enter_capture(comm):
    with comm.capture():
        pass


def _closed_checks(comm, rank, world_size):
    # one call that works, then close (collective), twice
    y = comm.all_reduce(torch.full((3,), float(rank + 1)))
    assert torch.equal(y, torch.full((3,), float(world_size * (world_size + 1) // 2)))
    comm.close()
    comm.close()
    assert "closed" in repr(comm)
    _closed_property(comm, rank, EXAMPLES_CLOSED)
    e = _raises_one_of(lambda: _enter_capture(comm), [(CommunicatorClosed, "closed")], "capture() after close()")
    assert isinstance(e, RuntimeError)  # documented: code catching RuntimeError keeps working
    # the group itself is untouched: torch.distributed still works on it
    t = torch.full((2,), rank, dtype=torch.int64)
    dist.all_reduce(t)
    assert t.tolist() == [sum(range(world_size))] * 2


def _body_closed(rank, world_size):
    _with_communicator(rank, world_size, lambda comm: _closed_checks(comm, rank, world_size))


class _WrongOnOneRank:
    """A Communicator whose all_reduce answer is off by one on the last rank,
    for non-empty 2-dim tensors only: a wrong answer the properties must
    catch."""

    def __init__(self, comm, rank, world_size):
        self.comm, self.wrong = comm, rank == world_size - 1

    def all_reduce(self, x, out=None):
        y = self.comm.all_reduce(x, out=out)
        if self.wrong and y.dim() == 2 and y.numel():
            first = y.view(-1)[:1]
            first.copy_(first.logical_not() if first.dtype == torch.bool else first + 1)
        return y


def _body_catches_wrong_answer(rank, world_size):
    _with_communicator(rank, world_size, lambda comm: _all_reduce_property(
        _WrongOnOneRank(comm, rank, world_size), rank, world_size, EXAMPLES_2))


# ------------------------------------------------------------------- tests

def test_all_reduce_property_two_ranks():
    """all_reduce(x, out=) on 2 ranks, over random shapes (0-4 dims, zero-size
    included), all 9 dtypes, contiguous / offset / permuted / step-sliced /
    expanded inputs, meta and non-tensor inputs, and out= None / x itself /
    a view of x / a fresh tensor (aligned or not) / wrong shape / wrong
    dtype / non-contiguous / meta / non-tensor. Pins: a valid call returns
    the exact sum (bitwise, -0.0 included; for bool the logical OR, see
    DTYPES) with x's shape and dtype, in a new tensor (input untouched) or
    in out (returned itself; x untouched unless out is x or a view of it);
    an invalid one raises TypeError("torch.Tensor") for a non-tensor,
    ValueError naming the device for a meta tensor, ValueError("shape and
    dtype") for a mismatched or non-contiguous out, changes nothing, and
    leaves the communicator working for the next example."""
    run_ranks(2, _body_all_reduce, timeout=RUN_TIMEOUT_S)


def test_all_gather_property_two_ranks():
    """all_gather(x, dim) on 2 ranks, over random shapes (0-4 dims, zero-size
    included), all 9 dtypes (bool included), every layout of x, meta and
    non-tensor inputs, and dims from -(ndim+2) to ndim+1, far out of range,
    or left to the default. Pins: a valid call returns torch.cat of every
    rank's x along dim (negative dims from the end), bitwise, contiguous,
    in new memory, input untouched; a non-tensor raises TypeError
    ("torch.Tensor"), a meta tensor ValueError naming the device, a 0-dim
    tensor ValueError("at least one dimension"), a dim out of range
    IndexError("out of range"), all without communicating."""
    run_ranks(2, _body_all_gather, timeout=RUN_TIMEOUT_S)


def test_properties_three_ranks():
    """Both properties above on an odd world size (3 ranks): the sums and
    concatenations take every rank, in rank order for all_gather."""
    run_ranks(3, _body_three_ranks, timeout=RUN_TIMEOUT_S)


def test_closed_communicator_property():
    """After close() (collective, idempotent), every call, with any
    arguments, raises without communicating: CommunicatorClosed (a
    TpcommError, hence RuntimeError, mentioning "closed") for valid
    arguments, that or the argument's own documented error for invalid
    ones; capture() raises CommunicatorClosed too; inputs are untouched and
    the process group still works."""
    run_ranks(2, _body_closed, timeout=RUN_TIMEOUT_S)


def test_property_catches_a_wrong_answer_on_one_rank():
    """Guards the properties themselves: an all_reduce that is wrong on one
    rank only, for one family of shapes, fails the run on every rank with
    the wrong rank's report (no hang while the other ranks pass)."""
    with pytest.raises(pytest.fail.Exception, match=r"(?s)--- rank 1: AssertionError: all_reduce result"):
        run_ranks(2, _body_catches_wrong_answer, timeout=RUN_TIMEOUT_S)
