"""Runs the C tests of the core (tests/c: csrc/core over a fake runtime)."""
import os
import re
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
C_DIR = os.path.join(HERE, "c")


def test_c_core():
    missing = [tool for tool in ("make", "gcc") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the C tests need {' and '.join(missing)}, which is not installed")
    proc = subprocess.run(["make", "-C", C_DIR, "test"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    output = proc.stdout
    assert proc.returncode == 0, f"make -C tests/c test exited {proc.returncode}:\n{output[-8000:]}"
    summary = re.findall(r"^(\d+) passed, (\d+) failed$", output, re.MULTILINE)
    assert len(summary) == 1, f"no single 'N passed, M failed' line in:\n{output[-8000:]}"
    passed, failed = map(int, summary[0])
    assert failed == 0, output[-8000:]
    assert passed > 0, output[-8000:]


def test_fast_path_refuses_codes_that_do_not_fit_a_c_enum():
    """tpcomm._fastpath passes dtype and algorithm to the C core as enums: a
    code beyond int would be truncated into another (2**32 + 1 into packet),
    so it is refused before the call; codes within int reach the core, which
    names what it refuses."""
    import tpcomm
    from tpcomm import _lib

    tpcomm.load()
    fast = _lib.fastpath()
    if fast is None:
        pytest.skip("tpcomm._fastpath is not built")
    for dtype, algo in ((0, 2**32 + 1), (2**32, 1), (-(2**40), 1)):
        with pytest.raises(ValueError, match="is not a C enum value"):
            fast.all_reduce(1, 0, 0, 16, dtype, algo, 0)
    # in range: the core answers (here: no communicator has this id)
    with pytest.raises(RuntimeError, match=r"comm_id 123456789 is unknown.*\[tpc_result 8\]"):
        fast.all_reduce(123456789, 0, 0, 16, 0, 1, 0)
