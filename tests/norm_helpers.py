"""What the CPU tests of the fusion patterns share: the ranks' inputs and
the residual and weights of the ops' tests (tests/test_norm_patterns_cpu.py,
tests/test_norm_fp8_cpu.py), an RMSNorm as model code writes it
(tests/test_fusion_users_cpu.py, tests/fp8_models.py), and the graph Dynamo
hands a backend with copies of it that read one more node
(tests/test_fusion_users_cpu.py, tests/test_fusion_fp8_negative_cpu.py). A
helper module, not a test module."""
import itertools

import torch


# ------------------------------------------------------------ the ops' inputs
def seeded(*axes):
    """(seed, value of each axis) for every combination of the axes' values,
    in the order of nested loops over them (the last axis innermost), the
    seeds counting from 1: each combination gets inputs of its own."""
    for seed, values in enumerate(itertools.product(*axes), 1):
        yield (seed, *values)


def pattern_inputs(rank, shape, dtype, seed):
    """Multiples of 1/8 below 8: sums exact in fp32 in any order (gloo's
    order is not the reference's rank order)."""
    g = torch.Generator().manual_seed(100 * seed + rank)
    return (torch.randint(-64, 65, shape, generator=g) / 8).to(dtype)


def pattern_shared(shape, dtype, seed):
    """Residual, weight (in [-0.5, 0.5)) and next weight (in [0.5, 1.5)), the same on every rank."""
    g = torch.Generator().manual_seed(7919 * seed)
    return (torch.randn(shape, generator=g).to(dtype), (torch.rand(shape[-1:], generator=g) - 0.5).to(dtype),
            (torch.rand(shape[-1:], generator=g) + 0.5).to(dtype))


# ------------------------------------------------------------------ models
def norm(kind, x, weight, eps=1e-6):
    """An RMSNorm of x as model code writes it: torch's F.rms_norm, Llama's
    (weight w) or Gemma's (weight 1 + w) code."""
    if kind == "functional":
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "llama":
        return weight * h.to(x.dtype)
    return (h * (1.0 + weight.float())).type_as(x)


# ------------------------------------------------------------------ graphs
def capture(model, *args):
    """The graph Dynamo hands a backend (node meta included) and the tensors it is called with."""
    seen = []

    def spy(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=spy, fullgraph=True)(*args)
    assert len(seen) == 1
    return seen[0]


def copy_graph(gm, extra=None):
    """A GraphModule of gm's graph (node names and meta kept), with the node
    named `extra` as one more output."""
    graph, env = torch.fx.Graph(), {}
    for node in gm.graph.nodes:
        if node.op != "output":
            env[node] = graph.node_copy(node, lambda n: env[n])
            continue
        outputs = tuple(torch.fx.node.map_arg(node.args[0], lambda n: env[n]))
        if extra is not None:
            outputs += (next(env[n] for n in env if n.name == extra),)
        graph.output(outputs)
    return torch.fx.GraphModule(gm, graph)
