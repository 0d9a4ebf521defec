"""Ranks that disagree on the fallback path where tpcomm's agreement check
is off (TPCOMM_FALLBACK_CHECK=0, as on NCCL by default;
tests/test_fallback_agreement_cpu.py tests the check): torch's cross-rank
check, TORCH_DISTRIBUTED_DEBUG=DETAIL, turns it into an error naming the
mismatch on every rank (docs/design.md, Failure model). Two gloo ranks, each op, a
shape and a dtype mismatch; the group stays usable after."""
import pytest
import torch
import torch.distributed as dist

import tpcomm
from multiproc import run_ranks

CASES = [("shapes 4096 vs 2048", lambda rank: torch.ones(4096 if rank == 0 else 2048)),
         ("fp32 vs bf16", lambda rank: torch.ones(2048, dtype=torch.float32 if rank == 0 else torch.bfloat16))]
OPS = {"all_reduce": lambda comm, x: comm.all_reduce(x),
       "all_gather": lambda comm, x: comm.all_gather(x, 0),
       "reduce_scatter": lambda comm, x: comm.reduce_scatter(x, 0)}


def _body(rank, world_size, op):
    # torch reads the variable when it starts; the harness set it after that
    # (a user's torchrun sets it before), so it is read again and the group
    # made after it, as init_process_group would make the world group.
    dist.set_debug_level_from_env()
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    comm = tpcomm.Communicator(dist.new_group(list(range(world_size))), device="cpu")
    for what, make in CASES:
        with pytest.raises(RuntimeError, match="(?s)Detected mismatch between collectives on ranks.*"
                                               "(Tensor Tensor shapes|Tensor dtypes|sizes|dtype)") as info:
            OPS[op](comm, make(rank))
        assert f"Rank {1 - rank}" in str(info.value) or "Rank 0" in str(info.value), str(info.value)
    y = comm.all_reduce(torch.ones(16))  # the group still works
    assert torch.equal(y, torch.full((16,), float(world_size)))
    comm.close()


@pytest.mark.parametrize("op", sorted(OPS))
def test_detail_debug_names_the_mismatch_on_every_rank(op):
    run_ranks(2, _body, op, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TPCOMM_FALLBACK_CHECK": "0"})
