"""examples/tp_fp8.py's FP8 tensor-parallel decoder on 2 gloo ranks (issue
48, item 3): for each quantization (static per-tensor, dynamic per-token,
per-token-group of 128), tpcomm.compile_backend fuses every all-reduce that
the residual add, an RMSNorm and the quantization of its normed output
follow into one _tpcomm.all_reduce_norm_fp8 call (the compile pass's
counts: all 2 * layers under "all_reduce_add_rms_norm_fp8", none left as a
fused norm without its quantization, the head's logits sum the only
all-reduce left), Communicator.stats() counts those calls (on the CPU their
unfused route: the all-reduce in fp32, the norm in fp32 rounded once, then
tpcomm.fp8.quantize), and the greedy tokens (argmax at every position) are
eager torch's.

Bits: in fp32 the model's own code computes what the fused op computes (a
sum of two ranks is one rounding either way; Llama's norm in fp32 is the
fused norm's arithmetic; the model's `amax / 448` and `x / s` are fp32
divisions on the CPU, as tpcomm.fp8's): the same codes and scales, so the
compiled model's logits equal eager torch's and torch.compile's without
tpcomm bit for bit. In bf16 they do not: the model rounds the sum and the
residual add to bf16 before its norm where the fused op keeps them in fp32
and rounds the normed output once (tpcomm.fusion's doc), a last bit that
can move an FP8 code by one step. There the logits must be as accurate as
eager torch's bf16 run, judged against the fp32 run of the same FP8 weights
(tests/logit_accuracy.py), and the tokens equal (the head tied to the
embedding makes every position's logits decisive: tp_fp8's doc)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import tpcomm

import logit_accuracy
import source_tree
from fp8_models import TP_FP8_KEY, check_tp_fp8
from multiproc import run_ranks

sys.path.insert(0, os.path.join(source_tree.ROOT, "examples"))
import tp_fp8  # noqa: E402
import tp_functional  # noqa: E402

def _run(model, x, comm, modes, inner="aot_eager"):
    return tp_functional.run_modes(model, x, comm, dist.group.WORLD, inner=inner, modes=modes)


def _body_aot_eager(rank, world_size, quant):
    comm = tpcomm.Communicator(device="cpu")
    x, issued = tp_fp8.example_input(), tp_fp8.collectives()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tp_fp8.build(rank, world_size, dist.group.WORLD, quant, dtype=dtype)
        results = _run(model, x, comm, ("torch", "compiled", "compiled_fused"))
        what = f"{quant} {dtype}"
        check_tp_fp8(results["compiled_fused"], issued, what, "unfused", ("gloo",))
        greedy, same = tp_fp8.tokens(results)
        assert same, (what, greedy)
        eager, fused = results["torch"]["out"], results["compiled_fused"]["out"]
        if dtype == torch.float32:  # the same arithmetic: the same bits (module doc)
            assert torch.equal(fused, eager) and torch.equal(fused, results["compiled"]["out"]), what
        else:  # the fused norm rounds once where the model rounds thrice: as accurate as eager torch's bf16
            assert logit_accuracy.failures(what, fused, eager, out[torch.float32]) == []
        out[dtype] = eager
    comm.close()


@pytest.mark.parametrize("quant", tp_fp8.QUANTS)
def test_every_norm_and_quantization_fused(quant):
    run_ranks(2, _body_aot_eager, quant, timeout=300)


def _body_inductor(rank, world_size):
    """Inductor after tpcomm's pass: the same fusion and counts; inductor's
    own code for the rest (its matmuls, softmax and the row-parallel inputs'
    quantization round otherwise than eager), so the tokens, and the logits
    near eager's."""
    comm = tpcomm.Communicator(device="cpu")
    x, issued = tp_fp8.example_input(), tp_fp8.collectives()
    for quant in tp_fp8.QUANTS:
        model = tp_fp8.build(rank, world_size, dist.group.WORLD, quant)
        results = _run(model, x, comm, ("torch", "compiled_fused"), inner="inductor")
        check_tp_fp8(results["compiled_fused"], issued, quant, "unfused", ("gloo",))
        greedy, same = tp_fp8.tokens(results)
        assert same, (quant, greedy)
        eager = results["torch"]["out"]
        diff = (results["compiled_fused"]["out"] - eager).abs().max().item()
        assert diff <= 0.05 * eager.std().item(), (quant, diff)
    comm.close()


def test_inductor():
    run_ranks(2, _body_inductor, timeout=600)


def test_dims_that_do_not_split_are_refused():
    tp_fp8.check_dims(tp_fp8.SMALL, 2, "group")
    with pytest.raises(ValueError, match="multiple of 128"):
        tp_fp8.check_dims(tp_fp8.SMALL, 4, "group")  # 64 columns a rank: no whole group of 128
    tp_fp8.check_dims(tp_fp8.SMALL, 4, "token")
    with pytest.raises(ValueError, match="heads"):
        tp_fp8.check_dims(dict(tp_fp8.SMALL, heads=3), 2, "static")


def test_dims_for_splits_at_every_world_size():
    """dims_for: SMALL itself at 2 ranks; at 2..8 ranks, dims that split
    (check_dims passes) and are no smaller than SMALL."""
    for quant in tp_fp8.QUANTS:
        assert tp_fp8.dims_for(2, quant) == tp_fp8.SMALL
        for world in range(2, 9):
            dims = tp_fp8.dims_for(world, quant)
            tp_fp8.check_dims(dims, world, quant)
            assert dims["hidden"] % dims["heads"] == 0, (world, quant, dims)
            assert all(dims[k] >= tp_fp8.SMALL[k] for k in ("hidden", "heads", "mlp")), (world, quant, dims)
    assert tp_fp8.dims_for(3, "group") == dict(tp_fp8.SMALL, hidden=384, heads=6, mlp=768)


def test_weight_quantization_round_trips():
    """quantize_weight, then dequantize_weight (fp8_linear's off _scaled_mm):
    the weight back within half an e4m3 step (2^-4 of the value) plus a
    subnormal's step of its scale."""
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(0))
    for quant in tp_fp8.QUANTS:
        codes, scales = tp_fp8.quantize_weight(w, quant)
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape, quant
        assert scales.shape == {"static": (), "token": (256, 1), "group": (2, 3)}[quant], (quant, scales.shape)
        err = (tp_fp8.dequantize_weight(codes, scales, quant) - w).abs()
        assert (err <= w.abs() / 16 + scales.max() * 2.0 ** -9).all(), quant


def test_command_line_runs_on_two_cpu_ranks_and_writes_nothing(tmp_path):
    """`python examples/tp_fp8.py --cpu --quant group`: every way gives eager
    torch's tokens, nothing is written into the checkout or left in TMPDIR."""
    before, tmp = source_tree.git_status(), tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, os.path.join(source_tree.ROOT, "examples", "tp_fp8.py"), "--cpu",
                           "--quant", "group"], capture_output=True, text=True, timeout=600, cwd=source_tree.ROOT,
                          env=source_tree.subprocess_env(TMPDIR=str(tmp)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "greedy tokens of every way equal eager torch's: True" in proc.stdout, proc.stdout[-3000:]
    assert f"'{TP_FP8_KEY}/unfused': 4" in proc.stdout, proc.stdout[-3000:]
    assert source_tree.git_status() == before and source_tree.tpcomm_leftovers(tmp) == []
