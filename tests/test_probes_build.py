"""The standalone CUDA probes under benchmarks/ compile: latency_probe.cu
(the stage timings in the README's "Where the time goes") against the current
kernels, so it cannot drift from the code it measures, and bandwidth_probe.cu
(the NVLink transfer rates behind the bulk kernels' design). They run only on
the device machine (2 GPUs)."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("probe", ["latency_probe.cu", "bandwidth_probe.cu"])
def test_probe_compiles(tmp_path, probe):
    exe = tmp_path / "probe"
    proc = subprocess.run([NVCC, "-O3", "-std=c++17", "-arch=sm_90", "-Werror", "all-warnings", "-I",
                           os.path.join(ROOT, "csrc"), os.path.join(ROOT, "benchmarks", probe),
                           "-o", str(exe)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert exe.stat().st_size > 0
