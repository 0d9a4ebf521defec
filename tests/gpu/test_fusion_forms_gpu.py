"""The compile pass's forms of issue 49 on GPUs, bf16, compiled with
tpcomm.compile_backend() (inductor): LayerNorm (nn.LayerNorm, F.layer_norm
without weight, OLMo's, Cohere's) before the add, after it and on both
sides, the residual multiplier, RMSNorm with the weight before the cast
(tests/test_fusion_forms_cpu.py's models), and the parallel block's two
all-reduces merged (tests/test_parallel_merge_cpu.py's). Each fuses once
under its pattern's key (the pass's counts and stats(), on whichever route
tpcomm.routing gives the pattern: the fused kernel where it takes it), no
plain all-reduce is left, every rank holds the same bits, and the values are
eager torch's within two bf16 ulps of the outputs' magnitude (the fused op
rounds once from fp32 where the model rounds at each step).

    TPCOMM_SHARE_GPU=1 TPCOMM_TEST_WORLD=2 python -m pytest -q -rs tests/gpu/test_fusion_forms_gpu.py   # and =3

Dry run of the body on CPU ranks (gloo, aot_eager; every call unfused):

    python tests/gpu/test_fusion_forms_gpu.py --cpu [--world N]
"""
import os
import sys

if __name__ == "__main__":  # the dry run: the helper modules' directories, as conftest.py puts them
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.dirname(_HERE), os.path.join(os.path.dirname(os.path.dirname(_HERE)), "python")]

import pytest
import torch

import multiproc
import tpcomm
from tpcomm.norm_patterns import STATS_KEY, Pattern

from fusion_form_models import HIDDEN, Parallel, fused_cases

pytestmark = pytest.mark.gpu
ULPS = 2 * 2.0 ** -7  # two bf16 ulps, relative


def _calls(comm, before):
    calls = {}
    for (op, how), v in comm.stats().items():
        calls[op] = calls.get(op, 0) + v["calls"] - before.get((op, how), {"calls": 0})["calls"]
    return {k: n for k, n in calls.items() if n}


def _body(rank, world, inner, on_gpu):
    from gpu_checks import no_compile_caches, same_on_all_ranks

    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    comm = tpcomm.Communicator(device=device)
    g = torch.Generator().manual_seed(5)
    w, b = torch.rand(HIDDEN, generator=g) + 0.5, torch.rand(HIDDEN, generator=g) - 0.5
    residual = torch.randn(6, HIDDEN, generator=g).to(torch.bfloat16).to(device)
    local = torch.Generator().manual_seed(100 + rank)
    y, y2 = (torch.randn(6, HIDDEN, generator=local).to(torch.bfloat16).to(device) for _ in range(2))
    cases = [(m, key, (y, residual), 0) for m, key, dynamic in fused_cases(comm.group_name, w, b) if not dynamic]
    cases.append((Parallel(comm.group_name, w), STATS_KEY[Pattern.ADD_NORM], (y, y2, residual), 1))
    for model, key, args, merged in cases:
        model = model.to(device=device, dtype=torch.bfloat16)
        what = f"{type(model).__name__} {getattr(model, 'kind', '')} at {world} ranks, {inner}"
        torch._dynamo.reset()
        backend = tpcomm.compile_backend(inner)
        with torch.no_grad(), no_compile_caches():
            eager = model(*args)
            before = comm.stats()
            got = torch.compile(model, backend=backend, fullgraph=True)(*args)
        assert backend.counts[key] == 1 and backend.counts["all_reduce_merged"] == merged, (what, backend.counts)
        assert _calls(comm, before) == {key: 1}, (what, comm.stats())
        for i, (a, e) in enumerate(zip(got, eager)):
            same_on_all_ranks(a, f"{what}, output {i}")
            scale = e.float().abs().max().item()
            assert (a.float() - e.float()).abs().max().item() <= ULPS * scale, (what, i)
    comm.close()


@pytest.mark.parametrize("inner", ["inductor", "aot_eager"])
def test_forms_fuse_on_gpus(inner):
    multiproc.run_gpu(_body, inner, True, timeout=600)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", required=True)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    multiproc.run_ranks(args.world, _body, "aot_eager", False, timeout=1200)
    print(f"at {args.world} CPU ranks: passed")
