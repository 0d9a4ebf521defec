"""examples/tp_functional.py's model (dist.all_reduce in place as
transformers calls it, funcol.all_reduce, and either a sequence-parallel
tail of dist.reduce_scatter_tensor and dist.all_gather_into_tensor with a
head gathered by funcol.all_gather_tensor, or only all-reduces) on GPUs,
bf16, with no change to the model: eager inside tpcomm.install, and
compiled with tpcomm.compile_backend (aot_eager and inductor) or with the
inductor pass object. Every body proves tpcomm's kernels ran (stats(): its
kernels and the fused add + RMSNorm kernel), not its fallback, with the
counts the form issues (tp_functional.collectives).

Where ranks share one GPU the harness groups them over gloo, whose
all-gather into one tensor (functional collectives' path) crashes on CUDA
tensors (pytorch#152645), so the reference path must not call it: there
the model runs in its all-reduce-only form. With one GPU per rank (NCCL) it
runs the sequence-parallel form.

Numerics: on 2 ranks a sum is a + b whichever rank adds, and tpcomm's
kernels and NCCL (or gloo) both round it once: the eager install and the
unfused rewrite give the reference's bits exactly. On more ranks the
summation order differs, and the fused op computes the residual add and
the norm in fp32, rounding once, where the model rounds to bf16 at each
step: there both are bf16 approximations of the same model run in fp32,
and the test requires them to lie within twice the reference's own
distance from that fp32 run (the bound if tpcomm's path is no less
accurate than the reference's)."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

import multiproc
from multiproc import run_gpu
import tpcomm
from tpcomm.graph_pass import COUNTED
from gpu_checks import KERNELS, no_compile_caches

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
import tp_functional  # noqa: E402

pytestmark = pytest.mark.gpu

def _ranks_share_a_gpu():
    try:
        return multiproc.gpus_shared()
    except ValueError:  # no GPU: conftest skips the GPU suite
        return False


def _all_reduce_only():
    """The form this machine's ranks can run: gloo (ranks sharing a GPU) has
    no CUDA all-gather the reference path could call."""
    return _ranks_share_a_gpu()


LAYERS = tp_functional.SMALL["layers"]


def _kernel_calls(calls, op):
    return sum(n for key, n in calls.items() if key.split("/")[0] == op and key.split("/")[1] in KERNELS)


def _assert_on_kernels(calls, expected, what):
    """calls ({"op/backend": n}) ran expected[op] calls of each op on
    tpcomm's kernels and none on its fallback."""
    for op, n in expected.items():
        assert _kernel_calls(calls, op) == n, (what, op, calls)
    assert not [k for k in calls if k.endswith("/nccl") or k.endswith("/unfused")], (what, calls)


def _close(out, ref, bound, what):
    diff = (out.float() - ref.float()).abs().max().item()
    assert diff <= bound, f"{what}: max |diff| {diff} > {bound}"


def _setup(rank, world, all_reduce_only):
    comm = tpcomm.Communicator()
    assert comm.enabled, comm.disabled_reason
    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    model = tp_functional.build(rank, world, group, dtype=torch.bfloat16, device=device,
                                all_reduce_only=all_reduce_only)
    x = tp_functional.example_input(world, dtype=torch.bfloat16, device=device)
    model32 = tp_functional.build(rank, world, group, dtype=torch.float32, device=device,
                                  all_reduce_only=all_reduce_only)
    with torch.no_grad():
        out32 = model32(x.float())
    return comm, group, model, x, out32


def _body_aot_eager(rank, world, all_reduce_only):
    comm, group, model, x, out32 = _setup(rank, world, all_reduce_only)
    results = tp_functional.run_modes(model, x, comm, group, inner="aot_eager")
    rows = tp_functional.summary(results)
    bound = 2 * (results["torch"]["out"].float() - out32).abs().max().item()
    exact = world == 2
    issued = tp_functional.collectives(all_reduce_only, LAYERS)
    rewrites = issued["rewrites"]

    _assert_on_kernels(rows["install"]["calls"], issued["dist"], "install")
    assert rows["compiled_tpcomm"]["rewrites"] == dict(dict.fromkeys(COUNTED, 0), **rewrites), \
        rows["compiled_tpcomm"]["rewrites"]
    _assert_on_kernels(rows["compiled_tpcomm"]["calls"], rewrites, "compiled_tpcomm")
    for mode, ref in (("install", "torch"), ("compiled_tpcomm", "compiled")):
        if exact:
            assert rows[mode]["bit_equal"], (mode, rows[mode]["max_abs_diff"])
        else:
            _close(results[mode]["out"], results[ref]["out"], bound, mode)

    fused = rows["compiled_fused"]
    assert fused["rewrites"]["all_reduce_add_rms_norm"] == issued["fused"], fused["rewrites"]
    assert fused["calls"].get("all_reduce_add_rms_norm/fused") == issued["fused"], fused["calls"]
    # every all-reduce an add + RMSNorm follows is fused (one kernel, no all_reduce of its own); the rest stay
    _assert_on_kernels({k: n for k, n in fused["calls"].items() if not k.startswith("all_reduce_add_rms_norm")},
                       dict(rewrites, all_reduce=rewrites["all_reduce"] - issued["fused"]), "compiled_fused")
    _close(results["compiled_fused"]["out"], results["compiled"]["out"], bound, "compiled_fused")
    comm.close()


def test_functional_model_aot_eager():
    run_gpu(_body_aot_eager, _all_reduce_only(), timeout=300)


def _body_inductor(rank, world, all_reduce_only):
    from tpcomm.inductor_pass import TpcommPass

    comm, group, model, x, out32 = _setup(rank, world, all_reduce_only)
    issued = tp_functional.collectives(all_reduce_only, LAYERS)
    with torch.no_grad():
        reference = model(x)
        bound = 2 * (reference.float() - out32).abs().max().item()
        torch._dynamo.reset()
        backend = tpcomm.compile_backend()  # inductor
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        compiled(x)
        before = comm.stats()
        out = compiled(x)
        calls = tp_functional.calls_since(comm, before)
        assert backend.counts["all_reduce_add_rms_norm"] == issued["fused"], backend.counts
        assert calls.get("all_reduce_add_rms_norm/fused") == issued["fused"], calls
        _close(out, reference, bound, "compile_backend() (inductor)")

        torch._dynamo.reset()
        tpcomm_pass = TpcommPass()
        # no cached graph: the pass must run here for its counts to prove it
        with no_compile_caches(post_grad_custom_post_pass=tpcomm_pass):
            compiled = torch.compile(model, fullgraph=True)
            compiled(x)
            before = comm.stats()
            out = compiled(x)
        calls = tp_functional.calls_since(comm, before)
        assert {op: tpcomm_pass.counts[op] for op in issued["rewrites"]} == issued["rewrites"], tpcomm_pass.counts
        # the post-grad pass fuses the add + RMSNorm it finds in aten form (tpcomm.aten_norms); each fused
        # call stands for one all-reduce, and every other all-reduce still runs on a kernel
        fused = tpcomm_pass.counts["all_reduce_add_rms_norm"]
        assert 0 < fused <= issued["fused"], tpcomm_pass.counts
        assert calls.get("all_reduce_add_rms_norm/fused") == fused, calls
        _assert_on_kernels({k: n for k, n in calls.items() if not k.startswith("all_reduce_add_rms_norm")},
                           dict(issued["rewrites"], all_reduce=issued["rewrites"]["all_reduce"] - fused), "TpcommPass")
        _close(out, reference, bound, "TpcommPass (inductor)")
    comm.close()


def test_functional_model_inductor():
    run_gpu(_body_inductor, _all_reduce_only(), timeout=600)
