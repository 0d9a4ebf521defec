"""The dispatcher-level ops torch.ops.tpcomm.custom_all_reduce(x, group_name) and
all_gather(x, dim, group_name): registered at import, fake shapes, and a
model compiled with fullgraph=True (aot_eager and inductor, mode
"reduce-overhead" too) giving the same answer as eager torch.distributed, on
2 gloo ranks (every call takes the fallback on CPU)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tpcomm
from bitexact import assert_bits_equal, exact_values, expected_sum
from multiproc import run_ranks


def test_ops_are_registered_at_import():
    assert str(torch.ops.tpcomm.custom_all_reduce.default._schema) == \
        "tpcomm::custom_all_reduce(Tensor x, str group_name) -> Tensor"
    assert str(torch.ops.tpcomm.custom_reduce_scatter.default._schema) == \
        "tpcomm::custom_reduce_scatter(Tensor x, SymInt dim, str group_name) -> Tensor"
    assert str(torch.ops.tpcomm.custom_all_gather.default._schema) == \
        "tpcomm::custom_all_gather(Tensor x, SymInt dim, str group_name) -> Tensor"


def test_unknown_group_name_raises():
    with pytest.raises(tpcomm.UnknownGroup, match="no open Communicator for group 'nobody'"):
        torch.ops.tpcomm.custom_all_reduce(torch.ones(4), "nobody")


class _Block(torch.nn.Module):
    """A row-parallel layer followed by a gather: the two collectives of a TP model."""

    def __init__(self, group_name):
        super().__init__()
        self.group_name = group_name

    def forward(self, x):
        y = torch.ops.tpcomm.custom_all_reduce(x * 2.0, self.group_name) + 1.0
        z = torch.ops.tpcomm.custom_all_gather(y, -1, self.group_name)
        return torch.ops.tpcomm.custom_reduce_scatter(z, -1, self.group_name)


def _body_compiled_models(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    x = exact_values(rank, (3, 8), torch.float32, seed=5)
    # all_reduce, then all_gather of identical parts, then reduce_scatter of those: world_size copies summed
    expected = (expected_sum(world_size, (3, 8), torch.float32, seed=5) * 2.0 + 1.0) * world_size
    block = _Block(comm.group_name)
    assert_bits_equal(block(x), expected, "eager")
    with FakeTensorMode():
        fake = torch.empty(3, 8)
        assert torch.ops.tpcomm.custom_all_gather(fake, 0, comm.group_name).shape == (3 * world_size, 8)
        assert torch.ops.tpcomm.custom_all_reduce(fake, comm.group_name).shape == (3, 8)
        assert torch.ops.tpcomm.custom_reduce_scatter(torch.empty(3, 8 * world_size), 1, comm.group_name).shape == (3, 8)
    for kwargs in ({"backend": "aot_eager", "fullgraph": True}, {"fullgraph": True},
                   {"fullgraph": True, "mode": "reduce-overhead"}):
        torch._dynamo.reset()
        compiled = torch.compile(block, **kwargs)
        for _ in range(2):  # the second call runs the compiled graph as it is
            assert_bits_equal(compiled(x), expected, f"compiled {kwargs}")
    comm.close()
    with pytest.raises(tpcomm.CommunicatorClosed, match="is closed"):
        torch.ops.tpcomm.custom_all_reduce(x, comm.group_name)


def test_compiled_model_matches_eager():
    run_ranks(2, _body_compiled_models, timeout=600)
