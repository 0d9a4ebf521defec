"""Every fusion pattern of tpcomm.norm_patterns on the fused kernel family
(csrc/kernels/all_reduce_norm.cuh) on real GPUs, through the private op
torch.ops._tpcomm.all_reduce_norm, against
tpcomm.reference.reference_all_reduce_norm: each RMS pattern with weight w
and 1 + w, each LayerNorm pattern with and without weight and bias, every
one with residual scales 1, 0.75 and -1.5 (tests/gpu/fused_norm_cases.py),
in bfloat16 and float16, 1, 3 and 8 rows of 2048 and one row of
TPC_NORM_MAX_ROW_BYTES, out of place ("spread") and in place; a random rank
late before every op and the inputs overwritten right after it; the same
bits on every rank; every call on the "fused" route, counted once under its
pattern's key.

The ranks' inputs are integer rows whose sums over the ranks have integer
means (fused_norm_cases.rank_input), so the first norm's scale is the
reference's bits: the stream output (z, o) is held bit for bit, as are
NORM_ADD's and LAYER_NORM_ADD's normed outputs (o itself). A norm of z or o
(the other normed outputs) sums values that are not integers, in the
kernel's order rather than torch's: within 1 ulp.

Runs at any world size from 2 to 8, with ranks sharing one GPU too
(TPCOMM_SHARE_GPU=1 TPCOMM_TEST_WORLD=N; tests/multiproc.py)."""
import collections

import pytest
import torch

import multiproc
from fused_norm_cases import EPS, NEXT_EPS, cases, check_counts_and_close, check_reference, fused_comm, late, \
    same_on_every_rank
from gpu_checks import delay_random_rank, shared_rng
from tpcomm import norm_patterns
from tpcomm.norm_patterns import STATS_KEY

pytestmark = pytest.mark.gpu


def body_patterns(rank, world):
    comm = fused_comm()
    rng = shared_rng(11)
    expected = collections.Counter()
    for case in cases(comm, rank, world, norm_patterns.route):
        pattern, offset, x, residual, weight, nw, what = (case.pattern, case.offset, case.x, case.residual,
                                                          case.weight, case.nw, case.what)
        kept_x, kept_r = x.clone(), residual.clone()
        normed, stream = late(rank, world, rng, x, residual, lambda: torch.ops._tpcomm.all_reduce_norm(
            x, residual, weight, nw, EPS, NEXT_EPS, offset, int(pattern), comm.group_name, *case.norm_args()))
        expected[(STATS_KEY[pattern], "fused")] += 1
        check_reference(case, kept_x, kept_r, normed, stream)
        same_on_every_rank(normed, f"normed {what}")
        same_on_every_rank(stream, f"stream {what}")
        # in place: normed into the input, the stream output into the residual (no "spread")
        xi, ri = kept_x.clone(), kept_r.clone()
        delay_random_rank(rank, world, rng)
        comm.kernels.all_reduce_norm(pattern, xi, ri, weight, nw, EPS, NEXT_EPS, offset, xi, ri, case.bias, case.nb,
                                     case.m)
        assert torch.equal(xi.view(torch.int16), normed.view(torch.int16)), f"in place normed {what}"
        assert torch.equal(ri.view(torch.int16), stream.view(torch.int16)), f"in place stream {what}"
    check_counts_and_close(comm, expected)


def test_norm_patterns_on_the_fused_kernel():
    multiproc.run_gpu(body_patterns, timeout=600)  # 108 cases, each twice
