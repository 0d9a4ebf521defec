"""tpcomm in one page. Run it with

    torchrun --nproc-per-node=2 examples/quickstart.py

With one CUDA GPU per rank the ranks use NCCL and the collectives run on
tpcomm's kernels; without GPUs they use gloo and tpcomm's fallback
(torch.distributed), which gives the same answers. Every rank checks every
result exactly (the inputs are small integers, whose sums bf16 holds
exactly) and rank 0 prints what ran.
"""
import os

import torch
import torch.distributed as dist

import tpcomm


def main():
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    on_gpus = torch.cuda.device_count() >= world
    # tpcomm never uses NVLink multicast; NCCL and torch stay off it too (set before NCCL starts).
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if on_gpus:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if on_gpus else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if on_gpus else torch.device("cpu")
    say = print if rank == 0 else (lambda *args: None)

    comm = tpcomm.Communicator()  # collective: every rank of the group (here the world) creates it
    say(comm)
    say("custom path:", "on" if comm.enabled else f"off ({comm.disabled_reason})")

    # all_reduce: every rank gives rank + 1; each gets 1 + 2 + ... + world.
    x = torch.full((4096,), rank + 1, dtype=torch.bfloat16, device=device)
    y = comm.all_reduce(x)
    assert torch.equal(y, torch.full_like(x, world * (world + 1) // 2)), y
    say(f"all_reduce      {x.nbytes} B of bf16 per rank -> {comm.route_all_reduce(x)}")

    # all_gather along the last dim: every rank's block side by side.
    part = torch.arange(8, dtype=torch.float16, device=device).reshape(2, 4) + 100 * rank
    gathered = comm.all_gather(part, dim=-1)
    expected = torch.cat([part - 100 * rank + 100 * r for r in range(world)], dim=-1)
    assert torch.equal(gathered, expected), gathered
    say(f"all_gather      {tuple(part.shape)} per rank, dim -1 -> {tuple(gathered.shape)}")

    # reduce_scatter along dim 0: rank r gets the sum of every rank's row block r.
    rows = torch.arange(world * 4, dtype=torch.float32, device=device).reshape(world, 4).repeat_interleave(2, 0)
    mine = comm.reduce_scatter(rows + rank, dim=0)
    assert torch.equal(mine, world * rows.chunk(world)[rank] + world * (world - 1) // 2), mine
    say(f"reduce_scatter  {tuple(rows.shape)} per rank -> {tuple(mine.shape)}")

    # The group-name op: what model code and torch.compile'd graphs call.
    z = torch.ops.tpcomm.custom_all_reduce(x, comm.group_name)
    assert torch.equal(z, y), z
    say(f"torch.ops.tpcomm.custom_all_reduce(x, {comm.group_name!r}) equals comm.all_reduce(x)")

    # The all-reduce with the residual add and RMSNorm after it, in one call.
    residual = torch.ones(2, 64, dtype=torch.bfloat16, device=device)
    weight = torch.ones(64, dtype=torch.bfloat16, device=device)
    normed, summed = comm.all_reduce_add_rms_norm(torch.full_like(residual, rank + 1), residual, weight, eps=0.0)
    assert torch.equal(summed, torch.full_like(residual, world * (world + 1) // 2 + 1)), summed
    assert torch.equal(normed, torch.ones_like(residual)), normed  # a constant row normalises to exactly 1
    say(f"all_reduce_add_rms_norm {tuple(residual.shape)} -> {comm.route_all_reduce_add_rms_norm(residual, weight)}")

    say("stats:", {f"{op}/{backend}": n for (op, backend), n in sorted(comm.stats().items())})
    comm.close()  # collective and bounded
    dist.destroy_process_group()
    say(f"quickstart: all checks passed on {world} ranks")


if __name__ == "__main__":
    main()
