"""benchmarks/quant_identity.cu: quant.cuh's hardware codec paths (e4m3
conversions, the absmax step) and its clamp-free integer codes give the
software rule's bits on every input the codec can see. Its CPU check runs
every fp32 bit pattern through the software encoder against cuda_fp8.h's
conversion, every code through the decoder, and every group absmax through
the integer codes' range bound; any difference fails. The same program with
`device` checks the instructions themselves on an sm_89+ GPU."""
import os
import subprocess

import pytest

from cuda_toolkit import NEEDS_NVCC, NVCC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(NVCC is None, reason=NEEDS_NVCC)
def test_hardware_codec_paths_match_the_software_rule_on_every_input(tmp_path):
    exe = tmp_path / "quant_identity"
    proc = subprocess.run([NVCC, "-O3", "-std=c++17", "-arch=sm_90", "-Werror", "all-warnings", "-I",
                           os.path.join(ROOT, "csrc"), os.path.join(ROOT, "benchmarks", "quant_identity.cu"), "-o",
                           str(exe)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.startswith("cpu: 4278190082 non-NaN values, 254 codes, the int clamps: 0 differences"), run.stdout
