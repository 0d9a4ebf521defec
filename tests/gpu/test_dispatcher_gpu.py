"""The group-name ops (torch.ops.tpcomm.all_reduce / all_gather) in a model
compiled with fullgraph=True, default mode and "reduce-overhead" (CUDA
graphs), on 2 GPUs: bit for bit what eager NCCL gives, through tpcomm's own
kernels (stats() proves the custom path ran)."""
import pytest
import torch
import torch.distributed as dist

import multiproc
import tpcomm
from gpu_checks import assert_bits_equal as _assert_bits_equal, int_valued as _int_valued, nccl_all_reduce as _nccl

pytestmark = pytest.mark.gpu


class _Block(torch.nn.Module):
    def __init__(self, group_name):
        super().__init__()
        self.group_name = group_name

    def forward(self, x):
        y = torch.ops.tpcomm.all_reduce(x * 2, self.group_name) + 1
        return torch.ops.tpcomm.all_gather(y, -1, self.group_name)


def _reference(x):
    y = _nccl(x * 2) + 1
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, y)
    return torch.cat(parts, -1)


def body_compiled_model(rank, world):
    comm = tpcomm.Communicator()
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(40 + rank)
    block = _Block(comm.group_name)
    for kwargs in ({"fullgraph": True}, {"fullgraph": True, "mode": "reduce-overhead"}):
        torch._dynamo.reset()
        compiled = torch.compile(block, **kwargs)
        for step in range(6):  # new inputs every step; reduce-overhead records, then replays
            x = _int_valued(8 * 512, torch.bfloat16, gen).view(8, 512)
            _assert_bits_equal(compiled(x).clone(), _reference(x), f"{kwargs} step {step}")
    stats = comm.stats()
    for op in ("all_reduce", "all_gather"):  # on tpcomm's kernels, whichever the table picks
        assert sum(s["calls"] for (o, b), s in stats.items() if o == op and b in tpcomm.policy.KERNELS) > 0, stats
    assert not any(b == "nccl" for _, b in stats), stats
    comm.check()
    comm.close()


def test_compiled_model():
    multiproc.run_gpu(body_compiled_model, timeout=300)
