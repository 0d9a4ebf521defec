"""examples/tp_fp8.py's FP8 tensor-parallel decoder on GPUs, bf16 (issue 48,
item 3's done-when): for each quantization, compiled with
tpcomm.compile_backend (aot_eager and inductor), every all-reduce that the
residual add, an RMSNorm and the quantization of its normed output follow
is one _tpcomm.all_reduce_norm_fp8 call that ran the fused kernel (stats():
"all_reduce_add_rms_norm_fp8/fused" for every call, none unfused), the head's
all-reduce ran one of tpcomm's kernels, and the greedy tokens (argmax at every
position) are eager torch's. The matmuls: torch._scaled_mm per tensor
(static) and rowwise (token: scale_a (M, 1), scale_b (1, N), bf16 out);
group dequantizes (torch has no block-scaled _scaled_mm on sm_90).

Run with ranks sharing one GPU (TPCOMM_SHARE_GPU=1 TPCOMM_TEST_WORLD=2) or a
GPU per rank; the model issues only all-reduces, so gloo's CUDA all-gather
(pytorch#152645) never runs.

Numerics: the fused kernel sums, adds the residual and normalizes in fp32,
rounding the normed output once, where the model rounds to bf16 at each
step; and on CUDA torch divides by the Python number 448 as a product with
its reciprocal where the kernel divides (docs/design.md, FP8 epilogues). So
some FP8 codes differ by a step from eager torch's, and the logits must be
as accurate as eager torch's bf16 run against the fp32 run of the same FP8
weights (tests/logit_accuracy.py), with the same tokens (the head tied to
the embedding makes every position decisive: tp_fp8's doc)."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

from multiproc import run_gpu
import tpcomm
from fp8_models import check_tp_fp8
from gpu_checks import KERNELS
import logit_accuracy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
import tp_fp8  # noqa: E402
import tp_functional  # noqa: E402

pytestmark = pytest.mark.gpu


def _body(rank, world, quant, inner):
    comm = tpcomm.Communicator()
    assert comm.enabled, comm.disabled_reason
    device, group = torch.device("cuda", torch.cuda.current_device()), dist.group.WORLD
    dims = tp_fp8.dims_for(world, quant)  # SMALL at 2 ranks, widened where it does not split
    x, issued = tp_fp8.example_input(dims, device=device), tp_fp8.collectives()
    with torch.no_grad():
        out32 = tp_fp8.build(rank, world, group, quant, dims, dtype=torch.float32, device=device)(x)
    model = tp_fp8.build(rank, world, group, quant, dims, dtype=torch.bfloat16, device=device)
    results = tp_functional.run_modes(model, x, comm, group, inner=inner, modes=("torch", "compiled_fused"))
    what = f"{quant} {inner} at {world} ranks"
    check_tp_fp8(results["compiled_fused"], issued, what, "fused", KERNELS)
    greedy, same = tp_fp8.tokens(results)
    assert same, (what, greedy)
    assert logit_accuracy.failures(what, results["compiled_fused"]["out"], results["torch"]["out"], out32) == []
    comm.close()


@pytest.mark.parametrize("quant", tp_fp8.QUANTS)
def test_fp8_model_aot_eager(quant):
    run_gpu(_body, quant, "aot_eager", timeout=300)


@pytest.mark.parametrize("quant", tp_fp8.QUANTS)
def test_fp8_model_inductor(quant):
    run_gpu(_body, quant, "inductor", timeout=600)
