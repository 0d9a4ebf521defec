"""examples/tp_functional.py's model on 2 gloo ranks, in both variants of
its tail (sequence parallel, or one more in-place dist.all_reduce): every
way it runs with tpcomm gives the torch path's logits (bit for bit unless
fused), issues the collectives tp_functional.collectives lists (the calls
tpcomm.install sees, the compile pass's rewrites, the fused add + RMSNorm
count), and the two variants give the same logits."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

import tpcomm
from multiproc import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import tp_functional  # noqa: E402

LAYERS = tp_functional.SMALL["layers"]


def _run(rank, world_size, comm, sequence_parallel):
    model = tp_functional.build(rank, world_size, dist.group.WORLD, sequence_parallel=sequence_parallel)
    x = tp_functional.example_input(world_size)
    results = tp_functional.run_modes(model, x, comm, dist.group.WORLD)
    return results, tp_functional.summary(results)


def _fallback(counts):
    """{op: n} as the CPU Communicator counts it: torch.distributed's fallback."""
    return {f"{op}/nccl": n for op, n in counts.items() if n}


def _body_example(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    logits = {}
    for sequence_parallel in (True, False):
        results, rows = _run(rank, world_size, comm, sequence_parallel)
        issued = tp_functional.collectives(sequence_parallel, LAYERS)
        what = f"sequence_parallel={sequence_parallel}"
        assert rows["install"]["bit_equal"] and rows["compiled_tpcomm"]["bit_equal"], (what, rows)
        assert rows["install"]["calls"] == _fallback(issued["dist"]), (what, rows["install"])
        assert rows["compiled_tpcomm"]["rewrites"] == dict(issued["rewrites"], all_reduce_add_rms_norm=0), \
            (what, rows["compiled_tpcomm"])
        assert rows["compiled_tpcomm"]["calls"] == _fallback(issued["rewrites"]), (what, rows["compiled_tpcomm"])
        fused = rows["compiled_fused"]
        assert fused["rewrites"]["all_reduce_add_rms_norm"] == issued["fused"], (what, fused)
        assert fused["calls"]["all_reduce_add_rms_norm/unfused"] == issued["fused"], (what, fused)
        assert fused["max_abs_diff"] <= 1e-5, (what, fused)  # fp32: the fused norm sums its squares in another order
        logits[sequence_parallel] = results["torch"]["out"]
    # on 2 ranks each sum is a + b, and the residual is added to it after the sum in both tails
    assert torch.equal(logits[True], logits[False])
    comm.close()


def test_example_tp_functional():
    run_ranks(2, _body_example, timeout=300)


@pytest.mark.parametrize("argv, sequence_parallel", [(["--cpu"], True), (["--cpu", "--no-sequence-parallel"], False),
                                                     (["--cpu", "--sequence-parallel"], True)])
def test_cli_chooses_the_tail(argv, sequence_parallel):
    assert tp_functional.parse(argv).sequence_parallel is sequence_parallel
