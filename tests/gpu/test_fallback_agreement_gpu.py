"""The fallback's agreement check (tpcomm._agreement) on NCCL, one rank per
GPU: off by default; with Config(fallback_check=True) a call the kernels do
not take (int64) raises CollectiveMismatch on every rank where the ranks
disagree and runs as before where they agree, and inside CUDA graph capture
the check is skipped: the captured NCCL call replays with new inputs."""
import pytest
import torch

import multiproc
import tpcomm

pytestmark = pytest.mark.gpu


def body_nccl_opt_in(rank, world):
    default = tpcomm.Communicator()
    assert default._agreement is None, "the check is off by default on NCCL"
    default.close()
    # all_gather forced onto NCCL (the kernels take every dtype); int64 all-reduces go there anyway
    comm = tpcomm.Communicator(config=tpcomm.Config(fallback_check=True, force=(("all_gather", "nccl"),)))
    total = world * (world + 1) // 2
    x = torch.full((64,), rank + 1, dtype=torch.int64, device="cuda")
    assert comm.route_all_reduce(x) == "nccl"
    assert torch.equal(comm.all_reduce(x), torch.full_like(x, total))
    with pytest.raises(tpcomm.CollectiveMismatch, match="shape differs"):
        comm.all_reduce(torch.ones(64 if rank == 0 else 32, dtype=torch.int64, device="cuda"))
    assert comm.route_all_gather(x) == "nccl"
    with pytest.raises(tpcomm.CollectiveMismatch, match="dtype differs"):
        comm.all_gather(torch.ones(64, dtype=torch.int64 if rank == 0 else torch.int32, device="cuda"), 0)
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        comm.all_reduce(static)  # checked eagerly; NCCL's communicator is up before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        out = comm.all_reduce(static)
    static.fill_(2 * (rank + 1))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 2 * total)), out
    del graph
    comm.close()


def test_nccl_opt_in_checks_eager_calls_and_skips_capture():
    if multiproc.gpus_shared():
        pytest.skip("needs NCCL, one GPU per rank (ranks share GPUs here)")
    multiproc.run_gpu(body_nccl_opt_in)
