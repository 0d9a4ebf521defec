"""tpcomm._ranks, the one launcher of ranks (tests/multiproc.py, the tools,
the examples and the benchmark scripts start theirs through it; its hang and
failure handling is tested through multiproc in test_multiproc_cpu.py) and
the one timer."""
import os
import time

from tpcomm import _ranks


def _writes_then_lingers(rank, world, init_method, path):
    if rank == 0:
        with open(path, "w") as f:
            f.write(init_method)
    time.sleep(600)  # a teardown that never ends


def test_ranks_that_linger_after_their_work_is_written_are_stopped(tmp_path):
    path = str(tmp_path / "done")
    with _ranks.rendezvous() as (init_method, tmp):
        assert init_method == "file://" + os.path.join(tmp, "store")
        procs = _ranks.start(2, _writes_then_lingers, init_method, path)
        begin = time.monotonic()
        outcome = _ranks.wait(procs, timeout_s=300, grace_s=1.0, done=lambda: os.path.exists(path))
    assert time.monotonic() - begin < 120
    assert outcome == _ranks.Outcome(failed=[], hung=[], stopped=[], lingered=[0, 1])
    assert [_ranks.exit_text(p.exitcode) for p in procs] == ["killed by SIGKILL"] * 2
    assert not os.path.exists(tmp)  # the rendezvous directory is removed
    with open(path) as f:
        assert f.read() == init_method


def test_seconds_per_call_on_the_host_clock():
    calls = []
    seconds = _ranks.seconds_per_call(lambda: calls.append(time.sleep(0.01)), 5, "cpu")
    assert len(calls) == 5 and 0.01 <= seconds < 1.0
