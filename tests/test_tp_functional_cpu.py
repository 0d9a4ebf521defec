"""examples/tp_functional.py's model on 2 gloo ranks, in both of its forms
(a sequence-parallel tail and a vocabulary-parallel head, or every
collective an all-reduce): every way it runs with tpcomm gives the torch
path's logits (bit for bit unless fused), issues the collectives
tp_functional.collectives lists (the calls tpcomm.install sees, the compile
pass's rewrites, the fused add + RMSNorm count), and the two forms compute
the same model."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import tpcomm
from tpcomm.graph_pass import COUNTED
from multiproc import run_ranks
import source_tree

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import tp_functional  # noqa: E402

LAYERS = tp_functional.SMALL["layers"]


def _run(rank, world_size, comm, all_reduce_only):
    model = tp_functional.build(rank, world_size, dist.group.WORLD, all_reduce_only=all_reduce_only)
    x = tp_functional.example_input(world_size)
    results = tp_functional.run_modes(model, x, comm, dist.group.WORLD)
    return results, tp_functional.summary(results)


def _fallback(counts):
    """{op: n} as the CPU Communicator counts it: torch.distributed's fallback (gloo)."""
    return {f"{op}/gloo": n for op, n in counts.items() if n}


def _body_example(rank, world_size):
    comm = tpcomm.Communicator(device="cpu")
    logits = {}
    for all_reduce_only in (False, True):
        results, rows = _run(rank, world_size, comm, all_reduce_only)
        issued = tp_functional.collectives(all_reduce_only, LAYERS)
        what = f"all_reduce_only={all_reduce_only}"
        assert rows["install"]["bit_equal"] and rows["compiled_tpcomm"]["bit_equal"], (what, rows)
        assert rows["install"]["calls"] == _fallback(issued["dist"]), (what, rows["install"])
        assert rows["compiled_tpcomm"]["rewrites"] == dict(dict.fromkeys(COUNTED, 0), **issued["rewrites"]), \
            (what, rows["compiled_tpcomm"])
        assert rows["compiled_tpcomm"]["calls"] == _fallback(issued["rewrites"]), (what, rows["compiled_tpcomm"])
        fused = rows["compiled_fused"]
        assert fused["rewrites"]["all_reduce_add_rms_norm"] == issued["fused"], (what, fused)
        assert fused["calls"]["all_reduce_add_rms_norm/unfused"] == issued["fused"], (what, fused)
        assert fused["max_abs_diff"] <= 1e-5, (what, fused)  # fp32: the fused norm sums its squares in another order
        logits[all_reduce_only] = _fp64_logits(rank, world_size, all_reduce_only)
    _assert_same_model(logits[False], logits[True])
    comm.close()


def _fp64_logits(rank, world_size, all_reduce_only):
    """The model in fp64 on the example input: the forms differ only in the
    order of the head's sums."""
    model = tp_functional.build(rank, world_size, dist.group.WORLD, dtype=torch.float64,
                                all_reduce_only=all_reduce_only)
    with torch.no_grad():
        return model(tp_functional.example_input(world_size, dtype=torch.float64))


def _assert_same_model(a, b):
    # each logit is a sum of ~128 products of magnitude < 1: fp64 orders differ by far less than 1e-12
    assert (a - b).abs().max().item() < 1e-12


def test_example_tp_functional():
    run_ranks(2, _body_example, timeout=300)


def _body_three_ranks(rank, world_size):
    """Both forms at a world size SMALL does not divide: the same logits."""
    sequence_parallel, all_reduce_only = (_fp64_logits(rank, world_size, form) for form in (False, True))
    dims = tp_functional.small(world_size)
    assert sequence_parallel.shape == (world_size * dims["tokens_per_rank"], dims["vocab"])
    _assert_same_model(sequence_parallel, all_reduce_only)


def test_example_at_three_ranks():
    run_ranks(3, _body_three_ranks, timeout=120)


@pytest.mark.parametrize("world", range(2, 9))
def test_small_dims_divide_among_any_world(world):
    dims = tp_functional.small(world)
    assert all(dims[k] % (8 * world) == 0 and dims[k] >= tp_functional.SMALL[k] for k in ("hidden", "mlp", "vocab"))
    if world in (2, 4, 8):
        assert dims == tp_functional.SMALL


@pytest.mark.parametrize("argv, all_reduce_only", [(["--cpu"], False), (["--cpu", "--all-reduce-only"], True)])
def test_cli_chooses_the_form(argv, all_reduce_only):
    assert tp_functional.parse(argv).all_reduce_only is all_reduce_only


def test_command_line_runs_on_two_cpu_ranks_and_writes_nothing(tmp_path):
    """`python examples/tp_functional.py --cpu` (its ranks started by
    tpcomm._ranks): every mode agrees, nothing is written into the checkout,
    nothing tpcomm's is left in TMPDIR."""
    before, tmp = source_tree.git_status(), tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, os.path.join(source_tree.ROOT, "examples", "tp_functional.py"), "--cpu"],
                          capture_output=True, text=True, timeout=600, cwd=source_tree.ROOT,
                          env=source_tree.subprocess_env(TMPDIR=str(tmp)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "calls=" in proc.stdout, proc.stdout[-3000:]
    assert source_tree.git_status() == before and source_tree.tpcomm_leftovers(tmp) == []
