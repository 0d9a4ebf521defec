"""benchmarks/quant_local.cu (the quantized all-reduce's local work beside a
device-to-device copy, on one GPU) compiles warning-free against the
current codecs (csrc/kernels/quant.cuh), so it cannot drift from the code
it measures, and its `list` mode (no GPU needed) names every row the device
run times; a grid argument out of range is refused before any GPU call.
Timing needs a GPU (scripts/device_run.sh quant_local)."""
import os
import subprocess

import pytest

from cuda_toolkit import NEEDS_NVCC, NVCC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(NVCC is None, reason=NEEDS_NVCC)
def test_quant_local_compiles_and_lists_its_rows(tmp_path):
    exe = tmp_path / "quant_local"
    proc = subprocess.run([NVCC, "-O3", "-std=c++17", "-arch=sm_90", "-Werror", "all-warnings", "-I",
                           os.path.join(ROOT, "csrc"), os.path.join(ROOT, "benchmarks", "quant_local.cu"), "-o",
                           str(exe)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = subprocess.run([str(exe), "list"], capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
    want = ["copy 16 MiB (cudaMemcpyAsync)", "read 16 MiB (quantize's loads)"]
    for mode in ("fp8", "int8", "int4"):
        want += [f"quantize {mode}"] + [f"dequant-sum {mode} n={n}" for n in (2, 4, 8)]
    assert [r for r in rows if r] == want
    bad = subprocess.run([str(exe), "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr, (bad.returncode, bad.stderr)
