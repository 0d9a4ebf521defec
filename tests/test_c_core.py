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
