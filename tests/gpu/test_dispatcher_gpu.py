"""The group-name ops (torch.ops.tpcomm.custom_all_reduce / all_gather) in a model
compiled with fullgraph=True, default mode and "reduce-overhead" (CUDA
graphs), at any world size: bit for bit what eager NCCL gives, through
tpcomm's own kernels (stats() proves the custom path ran), with a random
rank late before each step and the input overwritten right after it."""
import pytest
import torch

import multiproc
import tpcomm
from gpu_checks import (assert_bits_equal, delay_random_rank, int_valued, kernel_calls, nccl_all_gather,
                        nccl_all_reduce, no_compile_caches, overwrite, shared_rng, stats_label)

pytestmark = pytest.mark.gpu


class _Block(torch.nn.Module):
    def __init__(self, group_name):
        super().__init__()
        self.group_name = group_name

    def forward(self, x):
        y = torch.ops.tpcomm.custom_all_reduce(x * 2, self.group_name) + 1
        return torch.ops.tpcomm.custom_all_gather(y, -1, self.group_name)


def _reference(x):
    return nccl_all_gather(nccl_all_reduce(x * 2) + 1, -1)


def body_compiled_model(rank, world):
    comm = tpcomm.Communicator()
    assert comm.enabled, comm.disabled_reason
    gen = torch.Generator(device="cuda").manual_seed(40 + rank)
    rng = shared_rng(43)
    block = _Block(comm.group_name)
    for kwargs in ({"fullgraph": True}, {"fullgraph": True, "mode": "reduce-overhead"}):
        torch._dynamo.reset()
        compiled = torch.compile(block, **kwargs)
        for step in range(6):  # new inputs every step; reduce-overhead records, then replays
            x = int_valued(8 * 512, torch.bfloat16, gen).view(8, 512)
            kept = x.clone()
            delay_random_rank(rank, world, rng)
            with no_compile_caches():  # the disk caches would serve another world size's graph
                y = compiled(x).clone()
            overwrite(x)
            assert_bits_equal(y, _reference(kept), f"{kwargs} step {step}")
    for op in ("all_reduce", "all_gather"):  # on tpcomm's kernels, whichever the table picks
        assert kernel_calls(comm, op) > 0, comm.stats()
    assert stats_label(comm, "nccl") not in {b for _, b in comm.stats()}, comm.stats()
    comm.check()
    comm.close()


def test_compiled_model():
    multiproc.run_gpu(body_compiled_model, timeout=300)
