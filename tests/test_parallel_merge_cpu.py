"""The parallel block's two all-reduces made one under the compile pass
(tpcomm.parallel_merge), on gloo ranks: (a + m) + r and (r + a) + m, a and m
each an all-reduce's sum, become one all-reduce of the local sum, which the
fusion then fuses with the add and norm (counted: all_reduce_merged 1, the
pattern's key 1; stats() one fused call and no all-reduce). The result
is within docs/design.md's bound ("Parallel-residual merge") of the exact
sum, computed in fp64 from every rank's inputs, in bf16 at 3 ranks. A sum
also read elsewhere, or all-reduces of two groups, are left as two."""
import torch

import tpcomm
from tpcomm.norm_patterns import STATS_KEY, Pattern

from fusion_form_models import HIDDEN, Parallel
from multiproc import run_ranks

U32 = 2.0 ** -24


def _compiled(model, *args):
    torch._dynamo.reset()
    backend = tpcomm.compile_backend("aot_eager")
    with torch.no_grad():
        got = torch.compile(model, backend=backend, fullgraph=True)(*args)
        eager = model(*args)
    return got, eager, backend.counts


def _local(rank, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, HIDDEN, generator=g).to(dtype), torch.randn(4, HIDDEN, generator=g).to(dtype)


def _shared(dtype):
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, HIDDEN, generator=g).to(dtype), (torch.rand(HIDDEN, generator=g) + 0.5).to(dtype)


def _calls(comm, before):
    calls = {}
    for (op, how), v in comm.stats().items():
        calls[op] = calls.get(op, 0) + v["calls"] - before.get((op, how), {"calls": 0})["calls"]
    return {k: n for k, n in calls.items() if n}


def bound(ys, residual, dtype):
    """docs/design.md's bound on |z - exact| for the merged z, from the ranks' (y1, y2), in fp64:
    (u + u32) |T| + (u + (n - 1) u32) A, times (1 + 4u) for the second-order terms, where
    u is dtype's unit roundoff, T the exact r + sum_k (y1_k + y2_k) and A = sum_k |y1_k + y2_k|."""
    u, n = torch.finfo(dtype).eps / 2, len(ys)
    local = [y1.double() + y2.double() for y1, y2 in ys]
    exact = residual.double() + sum(local)
    a = sum(t.abs() for t in local)
    return exact, ((u + U32) * exact.abs() + (u + (n - 1) * U32) * a) * (1 + 4 * u)


def _body_merged(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    for dtype in (torch.float32, torch.bfloat16):
        residual, w = _shared(dtype)
        y1, y2 = _local(rank, dtype)
        exact, limit = bound([_local(k, dtype) for k in range(world_size)], residual, dtype)
        for residual_first in (False, True):
            what = f"{dtype} residual_first={residual_first}"
            before = comm.stats()
            got, eager, counts = _compiled(Parallel(comm.group_name, w, residual_first), y1, y2, residual)
            assert counts["all_reduce_merged"] == 1 and counts[STATS_KEY[Pattern.ADD_NORM]] == 1, (what, counts)
            assert _calls(comm, before) == {STATS_KEY[Pattern.ADD_NORM]: 1, "all_reduce": 2}, (what, comm.stats())
            error = (got[1].double() - exact).abs()
            assert (error <= limit).all(), (what, (error - limit).max())
    comm.close()


def test_two_summed_all_reduces_become_one_within_the_bound():
    run_ranks(3, _body_merged, timeout=600)


def _body_left_alone(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    other = torch.distributed.new_group([0, 1])
    comm2 = tpcomm.Communicator(other, device="cpu")
    residual, w = _shared(torch.float32)
    y1, y2 = _local(rank, torch.float32)
    for model in (Parallel(comm.group_name, w, keep=True),                    # a's sum read elsewhere
                  Parallel(comm.group_name, w, group2=comm2.group_name)):     # two groups
        got, eager, counts = _compiled(model, y1, y2, residual)
        assert counts["all_reduce_merged"] == 0, counts
        for g, e in zip(got, eager):
            assert torch.equal(g, e)
    comm2.close()
    comm.close()


def test_a_sum_read_elsewhere_or_two_groups_stay_two():
    run_ranks(2, _body_left_alone, timeout=600)
