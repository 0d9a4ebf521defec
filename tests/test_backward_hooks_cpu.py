"""tpcomm.skip_backward_hooks_without_grad (tpcomm.backward_hooks): a module
with a full backward hook or backward pre-hook (transformers 5.3 to 5.21's
q_norm / k_norm) compiles into one graph while grad is off, with the
outputs of the uncompiled model; with grad on, nothing changes: the hooks
stay registered, fire in backward with the gradients they always saw, and
Dynamo still stops at them."""
import copy

import pytest
import torch

import tpcomm


class _Norm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _hook(module, grad_input, grad_output):
    module.seen.append(("hook", grad_output[0].clone()))


def _pre_hook(module, grad_output):
    module.seen.append(("pre", grad_output[0].clone()))


class _Net(torch.nn.Module):
    """A linear, a norm holding backward hooks, a linear: where the hooks stop Dynamo."""

    def __init__(self, n=8):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.up = torch.nn.Linear(n, n)
        self.norm = _Norm(n)
        self.down = torch.nn.Linear(n, n)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.norm.seen = []  # what the hooks saw, in order (a copy's hooks append to the copy's)
        self.norm.register_full_backward_hook(_hook)
        self.norm.register_full_backward_pre_hook(_pre_hook)

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


def _backward(net, x):
    """The net's parameter gradients after one backward, and what its hooks saw."""
    net.zero_grad()
    net.norm.seen.clear()
    net(x).square().sum().backward()
    return [p.grad.clone() for p in net.parameters()], list(net.norm.seen)


def _graphs(net, x, fullgraph):
    """How many graphs torch.compile made of net(x), and the compiled output."""
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(net, backend=count, fullgraph=fullgraph)(x)
    return len(graphs), out


def test_hooks_skip_without_grad_and_stay_with_grad():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    net = _Net()
    reference = copy.deepcopy(net)
    hooks = dict(net.norm._backward_hooks), dict(net.norm._backward_pre_hooks)
    assert tpcomm.skip_backward_hooks_without_grad(net) == 1  # the norm alone holds hooks
    assert tpcomm.skip_backward_hooks_without_grad(net) == 1  # idempotent
    assert (dict(net.norm._backward_hooks), dict(net.norm._backward_pre_hooks)) == hooks, "the hooks stay registered"
    assert not {"_get_backward_hooks", "_get_backward_pre_hooks"} & set(vars(net.up)), "a module without hooks kept"

    with torch.no_grad():
        n, out = _graphs(net, x, fullgraph=True)  # fullgraph: a graph break raises
        assert n == 1 and torch.equal(out, reference(x))
    with torch.inference_mode():
        assert torch.equal(net(x), reference(x))

    # with grad: the hooks fire as on the untouched model, and Dynamo still stops at them
    grads, seen = _backward(net, x)
    want_grads, want_seen = _backward(reference, x)
    assert [k for k, _ in seen] == [k for k, _ in want_seen] == ["pre", "hook"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(seen, want_seen))
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="backwards hooks"):
        _graphs(net, x, fullgraph=True)
    n, out = _graphs(net, x, fullgraph=False)
    assert n >= 2 and torch.equal(out, reference(x))


def test_a_copy_skips_its_own_hooks():
    net = _Net()
    tpcomm.skip_backward_hooks_without_grad(net)
    twin = copy.deepcopy(net)
    assert twin.norm._get_backward_hooks.__self__ is twin.norm
    assert twin.norm._get_backward_pre_hooks.__self__ is twin.norm
    with torch.no_grad():
        assert _graphs(twin, torch.ones(2, 8), fullgraph=True)[0] == 1


def test_only_modules_are_taken():
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        tpcomm.skip_backward_hooks_without_grad(lambda x: x)
