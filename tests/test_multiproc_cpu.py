"""The test harness (tests/multiproc.py) keeps its promises: a failing rank's
traceback fails the test, first failure first; a hung rank is killed in
bounded time and named, with its stack; a crashed rank is named with its
signal; ranks meant to be killed are checked; every rank sees its env and
NVLink multicast off; GPU placement follows TPCOMM_SHARE_GPU and
TPCOMM_TEST_WORLD; and no test module imports another."""
import ast
import faulthandler
import os
import signal
import time

import pytest

import multiproc
from multiproc import run_ranks

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------- rank bodies
def _body_fails(rank, world_size):
    if rank == 1:
        raise AssertionError("rank 1 fails on purpose")


def _hang_here():
    time.sleep(600)


def _body_hangs(rank, world_size):
    if rank == 0:
        _hang_here()


def _crash_here():
    faulthandler._sigsegv()


def _body_crashes(rank, world_size):
    if rank == 1:
        _crash_here()


def _body_sees_its_environment(rank, world_size, expected_world):
    import torch.distributed as dist

    assert world_size == expected_world == dist.get_world_size() and rank == dist.get_rank()
    for name, value in multiproc.MULTICAST_OFF.items():
        assert os.environ[name] == value, (name, os.environ[name])
    assert os.environ["TPCOMM_TEST_HARNESS_PROBE"] == "set by the caller"


def _body_rank_1_killed(rank, world_size, die):
    import torch.distributed as dist

    # Rank 0 leaves only once rank 1 has joined: gloo's connections may still
    # be completing on rank 1 when rank 0's join returns, and rank 0's exit
    # would then fail rank 1's join instead of letting rank 1 die as meant.
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.set("rank 1 joined", "1")
        if die:
            os.kill(os.getpid(), signal.SIGKILL)
    else:
        store.wait(["rank 1 joined"])
    os._exit(0)  # the closing barrier would wait for the dead rank (as tests/gpu's SIGKILL test does)


# ------------------------------------------------------------------- tests
def test_a_failed_rank_fails_the_test_with_its_traceback():
    with pytest.raises(pytest.fail.Exception,
                       match=r"(?s)first to fail: rank 1\).*--- rank 1 ---.*AssertionError: rank 1 fails on purpose"):
        run_ranks(2, _body_fails)


def test_a_hung_rank_is_killed_and_named_with_its_stack():
    timeout = 30  # long enough for both ranks to start on a loaded machine
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks(2, _body_hangs, timeout=timeout)
    assert time.monotonic() - start < timeout + multiproc.STACK_DUMP_WAIT_S + 20
    text = str(failure.value)
    assert text.startswith(f"rank 0 did not finish within {timeout} s (killed)"), text
    assert "rank 1 returned from the body but waited at the closing barrier" in text, text
    rank0 = text[text.index("--- rank 0 (hung)"):text.index("--- rank 1 (hung)")]
    assert "_hang_here" in rank0 and "_body_hangs" in rank0, rank0


def test_a_crashed_rank_is_named_with_its_signal_and_stack():
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks(2, _body_crashes, timeout=60)
    text = str(failure.value)
    assert "first to fail: rank 1)" in text, text
    rank1 = text[text.index("--- rank 1 (killed by SIGSEGV) ---"):]
    assert "_crash_here" in rank1, rank1


def test_every_rank_gets_its_env_and_multicast_off(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the caller's environment cannot turn multicast on
    run_ranks(3, _body_sees_its_environment, 3,
              env={"TPCOMM_TEST_HARNESS_PROBE": "set by the caller", "NVSHMEM_DISABLE_NVLS": "0"})


def test_ranks_meant_to_be_killed():
    run_ranks(2, _body_rank_1_killed, True, expect_killed={1})
    with pytest.raises(pytest.fail.Exception, match="rank 1 was meant to be killed by a signal but ended with "
                                                    "exit status 0"):
        run_ranks(2, _body_rank_1_killed, False, expect_killed={1})


def test_bad_arguments_raise_before_spawning():
    with pytest.raises(ValueError, match="positive int"):
        run_ranks(0, _body_fails)
    with pytest.raises(ValueError, match="1 devices for 2 ranks"):
        run_ranks(2, _body_fails, devices=[0])


@pytest.mark.parametrize("gpus,env,expected", [
    (2, {}, (2, [0, 1], "nccl")),
    (8, {}, (8, list(range(8)), "nccl")),
    (8, {"TPCOMM_TEST_WORLD": "3"}, (3, [0, 1, 2], "nccl")),
    (1, {"TPCOMM_SHARE_GPU": "1"}, (2, [0, 0], "gloo")),
    (1, {"TPCOMM_SHARE_GPU": "1", "TPCOMM_TEST_WORLD": "5"}, (5, [0] * 5, "gloo")),
    (2, {"TPCOMM_SHARE_GPU": "yes", "TPCOMM_TEST_WORLD": "4"}, (4, [0, 1, 0, 1], "gloo")),
    (4, {"TPCOMM_SHARE_GPU": "1", "TPCOMM_TEST_WORLD": "4"}, (4, [0, 1, 2, 3], "nccl")),  # no need to share
])
def test_gpu_placement(gpus, env, expected):
    assert multiproc.gpu_placement(gpus, environ=env) == expected
    assert multiproc.gpu_skip_reason(gpus, environ=env) is None
    assert multiproc.shared_placement(expected[1]) == (expected[2] == "gloo")


def test_gpu_placement_with_a_fixed_world():
    assert multiproc.gpu_placement(1, world=2, environ={"TPCOMM_SHARE_GPU": "1", "TPCOMM_TEST_WORLD": "8"}) == \
        (2, [0, 0], "gloo")
    assert multiproc.gpu_placement(4, world=2, environ={"TPCOMM_TEST_WORLD": "4"}) == (2, [0, 1], "nccl")


@pytest.mark.parametrize("gpus,env,error", [
    (0, {}, "no CUDA GPU is visible"),
    (1, {}, "2 ranks need 2 GPUs"),
    (2, {"TPCOMM_TEST_WORLD": "4"}, "4 ranks need 4 GPUs .2 visible., or TPCOMM_SHARE_GPU=1"),
    (1, {"TPCOMM_SHARE_GPU": "1", "TPCOMM_TEST_WORLD": "9"}, "TPCOMM_TEST_WORLD='9': expected an integer from 2 to 8"),
    (1, {"TPCOMM_SHARE_GPU": "1", "TPCOMM_TEST_WORLD": "1"}, "TPCOMM_TEST_WORLD='1'"),
    (1, {"TPCOMM_SHARE_GPU": "1", "TPCOMM_TEST_WORLD": "three"}, "TPCOMM_TEST_WORLD='three'"),
    (1, {"TPCOMM_SHARE_GPU": "maybe"}, "TPCOMM_SHARE_GPU='maybe'"),
])
def test_gpu_placement_refuses_what_does_not_fit(gpus, env, error):
    with pytest.raises(ValueError, match=error):
        multiproc.gpu_placement(gpus, environ=env)
    reason = multiproc.gpu_skip_reason(gpus, environ=env)
    assert reason is not None and "docs/testing.md" in reason and "TPCOMM_SHARE_GPU=1" in reason


def _test_modules():
    for folder, _, files in os.walk(TESTS_DIR):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                yield os.path.join(folder, name)


def test_no_test_module_imports_another():
    names = {os.path.basename(p)[:-3] for p in _test_modules()}
    assert "test_multiproc_cpu" in names and "test_all_reduce_gpu" in names
    offenders = []
    for path in _test_modules():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                imported = [node.module or ""]
            else:
                continue
            offenders += [f"{os.path.relpath(path, TESTS_DIR)}:{node.lineno} imports {m}"
                          for m in imported if m.split(".")[-1] in names or m.split(".")[0] in names]
    assert not offenders, offenders
