"""tpcomm's torch ops have no backward (tpcomm._autograd): the ops
tpcomm.ops defines (the public custom_* ops and the private all_reduce_norm
the fusion writes) have an Autograd kernel; with inputs that require grad
each op's forward gives what it gives under torch.no_grad, and a backward
through it raises a RuntimeError naming the op. On 2 gloo ranks, eager and
compiled (compile_backend, the fused ops in the graph), a model whose
parameters require grad prints no warning (torch's "autograd kernel was not
registered" fallback warned and passed no gradient). Without grad the kernel
runs the op's function itself on plain tensors and redispatches to a key
below autograd that has a kernel of its own (a dispatch mode, fake and meta
tensors). The C++ binding's internal ops, on the Communicator's hot path,
have no Python kernel in front of them; the Communicator's methods, which
call them, give their outputs the same refusing backward where an input
requires grad (on every route, the fallback's included)."""
import contextlib
import re
import warnings
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import tpcomm
from tpcomm import ops
from tpcomm import norm_patterns
from tpcomm.norm_patterns import Pattern

from multiproc import run_ranks

COVERED = {"tpcomm::custom_all_reduce", "tpcomm::custom_all_gather", "tpcomm::custom_reduce_scatter",
           "tpcomm::custom_all_reduce_add_rms_norm", "_tpcomm::all_reduce_norm",
           "tpcomm::custom_all_reduce_add_rms_norm_fp8", "_tpcomm::all_reduce_norm_fp8"}
BINDING = {"_tpcomm::all_reduce", "_tpcomm::all_reduce_out", "_tpcomm::all_gather", "_tpcomm::reduce_scatter",
           "_tpcomm::reduce_scatter_f32", "_tpcomm::all_reduce_norm_out"}


def test_the_python_ops_alone_have_an_autograd_kernel():
    names = {op.name() for op in ops.registered()}
    assert COVERED | BINDING <= names
    with_kernel = {n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(n, "Autograd")}
    assert with_kernel == COVERED


@contextlib.contextmanager
def _no_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not caught, [f"{w.category.__name__}: {w.message}" for w in caught]


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _assert_refused(op_name, *outputs):
    loss = sum(o.float().sum() for o in outputs)
    with pytest.raises(RuntimeError, match=re.escape(f"tpcomm: {op_name} has no backward") + ".*for inference"):
        loss.backward()


def _check_op(op_name, call, make_inputs):
    """call(*inputs) with inputs that require grad gives its values under
    torch.no_grad, and its backward raises naming op_name; no warning."""
    with torch.no_grad():
        expected = _outputs(call(*make_inputs()))
    inputs = [t.requires_grad_() for t in make_inputs()]
    with _no_warnings():
        got = _outputs(call(*inputs))
        assert all(o.requires_grad for o in got), op_name
        for g, e in zip(got, expected):
            assert torch.equal(g, e), op_name
        _assert_refused(op_name, *got)


class _Model(torch.nn.Module):
    """Every public op and the private fused one, after a linear layer whose weight requires grad."""

    def __init__(self, group):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.group = group
        self.linear = torch.nn.Linear(64, 64, bias=False)
        self.w1 = torch.nn.Parameter(torch.rand(64, generator=g) + 0.5)
        self.w2 = torch.nn.Parameter(torch.rand(64, generator=g) + 0.5)

    def forward(self, x, residual):
        h = residual + torch.ops.tpcomm.custom_all_reduce(self.linear(x), self.group)  # fused when compiled
        normed = torch.nn.functional.rms_norm(h, (64,), self.w1, 1e-6)
        r = torch.ops.tpcomm.custom_reduce_scatter(torch.ops.tpcomm.custom_all_gather(normed, 0, self.group), 0,
                                                   self.group)
        n1, z1 = torch.ops.tpcomm.custom_all_reduce_add_rms_norm(r, h, self.w1, 1e-6, self.group)
        return torch.ops._tpcomm.all_reduce_norm(n1, z1, self.w1, self.w2, 1e-6, 1e-5, 1.0,
                                                 int(Pattern.NORM_ADD_NORM), self.group)


class _Recording(TorchDispatchMode):
    """Records the ops that reach the Python key."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def _check_dispatch(name, world_size):
    """Without a gradient to make, plain CPU tensors run the op's function
    from its Autograd kernel (no redispatch), grad mode on or off; a
    dispatch mode, meta and fake tensors are redispatched to, and get what
    their key's kernel gives."""
    op = torch.ops.tpcomm.custom_all_reduce
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))  # the same on every rank
    redispatched = []
    redispatch = torch._ops.OpOverload.redispatch

    def counting(self, keyset, *args, **kwargs):
        redispatched.append(self.name())
        return redispatch(self, keyset, *args, **kwargs)

    with mock.patch.object(torch._ops.OpOverload, "redispatch", counting):
        with torch.no_grad():
            assert torch.equal(op(x, name), x * world_size)
        assert torch.equal(op(x, name), x * world_size)
        assert redispatched == []
        with _Recording() as mode:
            assert torch.equal(op(x, name), x * world_size)
        assert mode.seen[0] is op.default, mode.seen
        meta = torch.ops.tpcomm.custom_all_gather(torch.empty(4, 64, device="meta"), 0, name)
        assert meta.device.type == "meta" and meta.shape == (4 * world_size, 64)
        with FakeTensorMode() as fake_mode:
            fake = op(fake_mode.from_tensor(x), name)
        assert fake.shape == x.shape and isinstance(fake, torch._subclasses.FakeTensor)
        assert redispatched == ["tpcomm::custom_all_reduce", "tpcomm::custom_all_gather",
                                "tpcomm::custom_all_reduce"], redispatched


def _body_ops(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    name = comm.group_name
    _check_dispatch(name, world_size)

    def make(*shapes):
        return lambda: [torch.randn(s, generator=torch.Generator().manual_seed(rank + i)) for i, s in
                        enumerate(shapes)]

    _check_op("tpcomm::custom_all_reduce", lambda x: torch.ops.tpcomm.custom_all_reduce(x, name), make((4, 64)))
    _check_op("tpcomm::custom_all_gather", lambda x: torch.ops.tpcomm.custom_all_gather(x, 1, name), make((4, 64)))
    _check_op("tpcomm::custom_reduce_scatter", lambda x: torch.ops.tpcomm.custom_reduce_scatter(x, 0, name),
              make((4, 64)))
    _check_op("tpcomm::custom_all_reduce_add_rms_norm",
              lambda x, r, w: torch.ops.tpcomm.custom_all_reduce_add_rms_norm(x, r, w, 1e-6, name),
              make((4, 64), (4, 64), (64,)))
    for pattern in Pattern:
        _check_op("_tpcomm::all_reduce_norm",
                  lambda x, r, w, nw, p=pattern: torch.ops._tpcomm.all_reduce_norm(
                      x, r, w, nw if p == Pattern.NORM_ADD_NORM else None, 1e-6, 1e-6, 0.0, int(p), name),
                  make((4, 64), (4, 64), (64,), (64,)))

    # a model whose parameters require grad, eager and compiled (the pass's fused ops in its graph)
    model = _Model(name)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    residual = torch.randn(4, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = model(x, residual)
    for compiled in (False, True):
        torch._dynamo.reset()
        backend = tpcomm.compile_backend("aot_eager")
        run = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
        with _no_warnings():
            got = run(x, residual)
            _assert_refused("_tpcomm::all_reduce_norm", *got)  # the last op of the forward, the first backward
        if compiled:
            assert backend.counts["all_reduce_add_rms_norm"] == 1, backend.counts
            torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
        else:
            assert all(torch.equal(g, e) for g, e in zip(got, expected))
    comm.close()


def test_each_op_and_a_model_refuse_the_backward_and_plain_calls_skip_the_redispatch():
    run_ranks(2, _body_ops, timeout=300)


def _body_methods(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")

    def make(*shapes):
        return lambda: [torch.randn(s, generator=torch.Generator().manual_seed(rank + i)) for i, s in
                        enumerate(shapes)]

    _check_op("all_reduce", comm.all_reduce, make((4, 64)))
    _check_op("all_reduce", lambda x, o: comm.all_reduce(x, out=o.detach()), make((4, 64), (4, 64)))
    _check_op("all_gather", lambda x: comm.all_gather(x, 1), make((4, 64)))
    _check_op("reduce_scatter", lambda x: comm.reduce_scatter(x, 1), make((4, 64)))
    _check_op("all_reduce_add_rms_norm", lambda x, r, w: comm.all_reduce_add_rms_norm(x, r, w, 1e-6),
              make((4, 64), (4, 64), (64,)))
    # in place: into non-leaf tensors (a leaf that requires grad cannot be written in place)
    _check_op("all_reduce_add_rms_norm",
              lambda x, r, w: comm.all_reduce_add_rms_norm(x * 1, r * 1, w, 1e-6, in_place=True),
              make((4, 64), (4, 64), (64,)))
    with torch.no_grad():  # no gradient needed: plain tensors, as before
        assert not comm.all_reduce(torch.ones(4, 64, requires_grad=True)).requires_grad
    # in place into a leaf that requires grad (dist.all_reduce(param) under install()): written
    # unrecorded, as torch.distributed's in-place collectives write
    param = torch.nn.Parameter(torch.full((4, 64), float(rank + 1)))
    assert comm.all_reduce(param, out=param) is param and torch.equal(param, torch.full((4, 64), 3.0))
    with tpcomm.install(comm.group):
        torch.distributed.all_reduce(param, group=comm.group)
    assert torch.equal(param.detach(), torch.full((4, 64), 6.0))
    x, r = (torch.nn.Parameter(torch.ones(4, 64)) for _ in range(2))
    normed, z = comm.all_reduce_add_rms_norm(x, r, torch.nn.Parameter(torch.ones(64)), 1e-6, in_place=True)
    assert normed is x and z is r and torch.equal(z, torch.full((4, 64), 3.0))
    comm.close()
    with pytest.raises(tpcomm.CommunicatorClosed):
        norm_patterns.run(comm, int(Pattern.NORM_ADD), *(torch.ones(4, 64) for _ in range(2)), torch.ones(64),
                          None, 1e-6, 0.0, 0.0)


def test_the_communicators_methods_refuse_the_backward():
    run_ranks(2, _body_methods, timeout=300)
