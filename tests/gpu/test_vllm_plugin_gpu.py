"""tpcomm.integrations.vllm with tpcomm's kernels: the plugin's communicator
over the vLLM stand-in (tests/data/vllm_stand_in, checked against the pinned
release by tests/test_vllm_contract.py) and the real tpcomm.Communicator, on
CUDA ranks. What tpcomm takes runs on its kernels (stats() names them) bit
for bit equal to the exact sum; what it declines reaches vLLM's communicator;
a CUDA graph captured the way vLLM captures (no tpcomm context entered)
replays correctly; destroy closes the Communicator."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

from tpcomm.integrations import vllm as plugin

from gpu_checks import KERNELS
from multiproc import run_gpu

pytestmark = pytest.mark.gpu

STAND_IN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "vllm_stand_in")


def _values(rank, shape, dtype, seed):
    """Integers in [-8, 8]: their sums over up to 8 ranks are exact in every
    float dtype tested, so any summation order gives the same bits."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def _sum(world, shape, dtype, seed):
    return sum(_values(r, shape, dtype, seed).double() for r in range(world)).to(dtype)


def _check(actual, expected, what):
    actual = actual.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert torch.equal(actual, expected), what


def body_vllm_plugin(rank, world):
    sys.path.insert(0, STAND_IN)
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    cls = plugin.communicator_class(CudaCommunicator)
    device = torch.device("cuda", torch.cuda.current_device())
    c = cls(cpu_group=dist.new_group(backend="gloo"), device=device, device_group=dist.group.WORLD,
            unique_name="tp:0")
    comm = c.tpcomm
    assert comm is not None, c.tpcomm_reason

    for seed, (shape, dtype) in enumerate([((64,), torch.bfloat16), ((8, 4096), torch.bfloat16),
                                           ((16, 4096), torch.float16), ((256, 4096), torch.float32)]):
        x = _values(rank, shape, dtype, seed).to(device)
        assert comm.route_all_reduce(x) in KERNELS, (shape, dtype)
        _check(c.all_reduce(x), _sum(world, shape, dtype, seed), f"all_reduce {shape} {dtype}")
    for dim in (0, -1):
        x = _values(rank, (4, 1024), torch.bfloat16, 10)
        expected = torch.cat([_values(r, (4, 1024), torch.bfloat16, 10) for r in range(world)], dim)
        _check(c.all_gather(x.to(device), dim), expected, f"all_gather dim {dim}")
    for dim in (0, 1):
        shape = (world * 8, world * 512)
        x = _values(rank, shape, torch.bfloat16, 20).to(device)
        expected = _sum(world, shape, torch.bfloat16, 20).chunk(world, dim)[rank].contiguous()
        _check(c.reduce_scatter(x, dim), expected, f"reduce_scatter dim {dim}")
    assert sum(c.calls.values()) == 0, c.calls  # tpcomm took every call above
    used = {key for key, s in comm.stats().items() if s["calls"]}
    assert used and all(backend in KERNELS for _, backend in used), used
    assert {op for op, _ in used} == {"all_reduce", "all_gather", "reduce_scatter"}, used

    ints = _values(rank, (8, 16), torch.int64, 30).to(device)  # tpcomm has no integer sums
    _check(c.all_reduce(ints), _sum(world, (8, 16), torch.int64, 30), "declined all_reduce")
    assert c.calls["all_reduce"] == 1

    # Captured as vLLM's GroupCoordinator.graph_capture does: on a side
    # stream, entering only vLLM's own backends' contexts.
    static = torch.zeros((8, 4096), dtype=torch.bfloat16, device=device)
    c.all_reduce(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        out = c.all_reduce(static)
    for replay in range(5):
        static.copy_(_values(rank, (8, 4096), torch.bfloat16, 40 + replay).to(device))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, _sum(world, (8, 4096), torch.bfloat16, 40 + replay), f"replay {replay}")
    comm.check()
    assert c.calls["all_reduce"] == 1

    c.destroy()
    assert c.tpcomm is None and not comm.enabled and c.destroyed


def test_vllm_plugin_on_tpcomms_kernels():
    run_gpu(body_vllm_plugin)
