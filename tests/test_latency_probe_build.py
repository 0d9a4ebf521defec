"""benchmarks/latency_probe.cu (the stage timings in the README's "Where the
time goes") compiles against the current kernels, so the probe cannot drift
from the code it measures. It runs only on the device machine (2 GPUs)."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_latency_probe_compiles(tmp_path):
    exe = tmp_path / "probe"
    proc = subprocess.run([NVCC, "-O3", "-std=c++17", "-arch=sm_90", "-Werror", "all-warnings", "-I",
                           os.path.join(ROOT, "csrc"), os.path.join(ROOT, "benchmarks", "latency_probe.cu"),
                           "-o", str(exe)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert exe.stat().st_size > 0
