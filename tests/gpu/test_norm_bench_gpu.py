"""The benchmark's fused norm cases (tpcomm.bench.norm_cases) on real GPUs:
every norm op (ADD_NORM and its per_tensor, per_token and per_token_group
FP8 epilogues) on each of its backends (the dispatcher, the fused kernel
forced, the route past the cap) at hidden 4096 and 8192, token counts on
both sides of the packet cap, divisible by the world size or not; each
case's check (stream output bit for bit, normed within 1 ulp of
tpcomm.reference, codes and scales fp8.quantize of the normed output bit for
bit, the timed call's codes those of the checked one) true on every rank,
twice in a row. Then a table of its own capping the fused kernel at 64 KiB:
the dispatcher's route past it is ADD_NORM "split" where the rows divide,
else "unfused", the FP8 epilogues "unfused", each checked the same way.

Runs at any world size from 2 to 8, with ranks sharing one GPU too
(TPCOMM_SHARE_GPU=1 TPCOMM_TEST_WORLD=N; tests/multiproc.py)."""
import types

import pytest
import torch

import multiproc
import tpcomm
from tpcomm import routing_table
from tpcomm.bench import cases, norm_cases, vocabulary
from tpcomm.bench.inputs import make_input
from tpcomm.config import Config

pytestmark = pytest.mark.gpu

KiB, MiB = 1024, 1024 * 1024
BACKENDS = ("tpcomm",) + norm_cases.NORM_BACKENDS


def _x0(rank, tokens, hidden):
    return make_input(rank, "norm", torch.bfloat16, tokens * hidden, "cuda").view(tokens, hidden)


def _run_checked(backend, op, x0, res):
    """The case's route after two calls each checked, or None where the fused kernel declines past the packet cap."""
    try:
        case = cases.make_case(backend, op, x0, res)
    except cases.Unavailable as e:
        assert backend == "tpcomm_fused" and "is over the packet cap" in str(e), (backend, op, tuple(x0.shape), e)
        assert x0.numel() * x0.element_size() > res.comm.packet_max_bytes
        return None
    for _ in range(2):
        case.prepare()
        assert case.check(case.call()), (backend, op, tuple(x0.shape), case.route)
    return case.route


def body_norm_cases(rank, world):
    comm = tpcomm.Communicator(packet_max_bytes=1 * MiB, config=Config.from_env().replace(fused_kernel=True))
    assert comm.enabled, comm.disabled_reason
    res = types.SimpleNamespace(reasons={}, world=world, comm=comm)
    for hidden in (4096, 8192):
        row = hidden * 2
        for tokens in (1, 3, 8 * world, 8 * world + 1, MiB // row, MiB // row + world):
            x0 = _x0(rank, tokens, hidden)
            for op in vocabulary.NORM_OPS:
                routes = {b: _run_checked(b, op, x0, res) for b in BACKENDS}
                fits = tokens * row <= min(MiB, routing_table.fused_norm_default(world))  # the shipped table has no cap
                assert routes["tpcomm"] == ("fused" if fits else routes["tpcomm_past_cap"]), (op, tokens, routes)
                assert routes["tpcomm_fused"] == ("fused" if tokens * row <= MiB else None), (op, tokens, routes)
                past = "split" if op == vocabulary.NORM_OPS[0] and tokens % world == 0 else "unfused"
                assert routes["tpcomm_past_cap"] == past, (op, tokens, routes)
    comm.close()

    table = {**routing_table.load_table(), "fused_norm_max_bytes": {"*": 64 * KiB}}
    capped = tpcomm.Communicator(packet_max_bytes=1 * MiB, table=table,
                                 config=Config.from_env().replace(fused_kernel=True))
    res = types.SimpleNamespace(reasons={}, world=world, comm=capped)
    for tokens in (8, 16 * world, 16 * world + 1):  # 64 KiB, then past it
        x0 = _x0(rank, tokens, 4096)
        for op in vocabulary.NORM_OPS:
            want = ("fused" if tokens * 8 * KiB <= 64 * KiB else
                    "split" if op == vocabulary.NORM_OPS[0] and tokens % world == 0 else "unfused")
            assert _run_checked("tpcomm", op, x0, res) == want, (op, tokens)
    capped.close()


def test_norm_bench_cases():
    multiproc.run_gpu(body_norm_cases, timeout=600)
