"""tpcomm's ops have no backward (tpcomm._autograd): every op tpcomm
registers, public and private, the C++ binding's included, has an Autograd
kernel; with inputs that require grad each op's forward gives what it gives
under torch.no_grad, and a backward through it raises a RuntimeError naming
the op. On 2 gloo ranks, eager and compiled (compile_backend, the fused ops
in the graph), a model whose parameters require grad prints no warning
(torch's "autograd kernel was not registered" fallback warned and passed no
gradient). The binding's ops, whose CPU kernels refuse, run on stand-in CPU
kernels in a process of their own: what is tested is the Autograd kernel in
front of them."""
import contextlib
import re
import warnings

import pytest
import torch

import tpcomm
from tpcomm import _autograd, ops
from tpcomm.norm_patterns import Pattern

from multiproc import run_ranks


def test_every_op_has_an_autograd_kernel():
    names = [op.name() for op in ops.registered()]
    assert {"tpcomm::custom_all_reduce", "_tpcomm::all_reduce_norm", "_tpcomm::all_reduce_out"} <= set(names)
    missing = [n for n in names if n != _autograd.NO_BACKWARD
               and not torch._C._dispatch_has_kernel_for_dispatch_key(n, "Autograd")]
    assert not missing, missing


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


def _body_ops(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    name = comm.group_name

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


def test_each_op_and_a_model_refuse_the_backward():
    run_ranks(2, _body_ops, timeout=300)


def _stand_ins():
    """CPU kernels for the binding's ops (their own refuse the CPU): 2x the
    input for a sum over 2 ranks, the input twice for a gather, half for a
    scatter; the out= ops write into their outputs."""
    def all_reduce_out(x, out, comm_id, algo):
        out.copy_(x * 2)

    def all_reduce_norm_out(x, r, w, nw, eps, next_eps, offset, pattern, normed, stream, comm_id):
        normed.copy_(x * w)
        stream.copy_(r)

    library = torch.library.Library("_tpcomm", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
        library.impl("all_reduce", lambda x, comm_id, algo: x * 2, "CPU")
        library.impl("all_reduce_out", all_reduce_out, "CPU")
        library.impl("all_gather", lambda x, dim, comm_id, algo: torch.cat([x, x], dim), "CPU")
        library.impl("reduce_scatter", lambda x, comm_id, algo: x[: x.shape[0] // 2] * 2, "CPU")
        library.impl("reduce_scatter_f32", lambda x, comm_id, algo: x[: x.shape[0] // 2].float() * 2, "CPU")
        library.impl("all_reduce_norm_out", all_reduce_norm_out, "CPU")
    return library


def _body_binding_ops(rank, world_size):
    library = _stand_ins()
    _tpcomm = torch.ops._tpcomm

    def make(*shapes):
        return lambda: [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]

    _check_op("_tpcomm::all_reduce", lambda x: _tpcomm.all_reduce(x, 1, 0), make((4, 16)))
    _check_op("_tpcomm::all_gather", lambda x: _tpcomm.all_gather(x, 0, 1, 0), make((4, 16)))
    _check_op("_tpcomm::reduce_scatter", lambda x: _tpcomm.reduce_scatter(x, 1, 0), make((4, 16)))
    _check_op("_tpcomm::reduce_scatter_f32", lambda x: _tpcomm.reduce_scatter_f32(x, 1, 0), make((4, 16)))

    def all_reduce_out(x):
        out = torch.empty_like(x)
        assert _tpcomm.all_reduce_out(x, out, 1, 0) is None
        return out

    def norm_out(x, r, w):
        normed, stream = torch.empty_like(x), torch.empty_like(r)
        _tpcomm.all_reduce_norm_out(x, r, w, None, 1e-6, 1e-6, 0.0, int(Pattern.ADD_NORM), normed, stream, 1)
        return normed, stream

    # the out= ops: what they write takes the backward
    _check_op("_tpcomm::all_reduce_out", all_reduce_out, make((4, 16)))
    _check_op("_tpcomm::all_reduce_norm_out", norm_out, make((4, 16), (4, 16), (16,)))
    library._destroy()


def test_binding_ops_refuse_the_backward():
    run_ranks(1, _body_binding_ops, timeout=120)
