"""Source files read out of a pinned wheel from PyPI, for the contract tests
of integrations whose package cannot be imported here (AITER needs ROCm,
vLLM a CUDA build of its own). Without network the caller's test skips,
except in CI (CI=true), where it fails: a contract never checked is no
contract."""
import os
import subprocess
import sys
import zipfile

import pytest


def read_sources(requirement, paths, where, pip_args=(), timeout=900):
    """{path: text} of `paths` inside the wheel `requirement` downloads into
    `where` (the wheel itself is deleted after reading)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *pip_args,
                           "-d", str(where), requirement], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"could not download {requirement}: {proc.stderr[-2000:]}")
        pytest.skip(f"could not download {requirement} (no network?)")
    wheel = next(where.glob("*.whl"))
    with zipfile.ZipFile(wheel) as z:
        sources = {path: z.read(path).decode() for path in paths}
    wheel.unlink()
    return sources
