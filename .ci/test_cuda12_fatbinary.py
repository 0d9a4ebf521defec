"""The CUDA 12 build's fatbinary stand-in (scripts/cuda12/fatbinary) wraps a
cubin that the CUDA 12.8 ptxas made into a fatbin container. Needs the
toolkit that .ci/wheel.sh cu128 assembles from PyPI (scripts/cuda12_toolkit.sh),
so .ci/run runs it after the wheels, not with the README's test command."""
import os
import struct
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cuda12_toolkit():
    for path in (os.environ.get("CUDA12_TOOLKIT", ""), os.path.join(ROOT, ".whl", "cuda12.8")):
        if path and os.path.exists(os.path.join(path, "lib64", "libnvfatbin.so.12")):
            return path
    return None


@pytest.mark.skipif(_cuda12_toolkit() is None, reason="needs the CUDA 12 toolkit of scripts/cuda12_toolkit.sh "
                    "(CUDA12_TOOLKIT, or .whl/cuda12.8 after .ci/wheel.sh cu128)")
def test_fatbinary_wraps_a_cubin_that_ptxas_made(tmp_path):
    toolkit = _cuda12_toolkit()
    ptx = tmp_path / "k.ptx"
    ptx.write_text(".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k() { ret; }\n")
    cubin = tmp_path / "k.cubin"
    subprocess.run([os.path.join(toolkit, "bin", "ptxas"), "-arch=sm_90", str(ptx), "-o", str(cubin)], check=True)
    out = tmp_path / "k.fatbin"
    subprocess.run([sys.executable, os.path.join(toolkit, "bin", "fatbinary"), "-64", "--create", str(out),
                    f"--image=profile=sm_90,file={cubin}", f"--image=profile=compute_90,file={ptx}"], check=True)
    data = out.read_bytes()
    magic, version, header = struct.unpack_from("<IHH", data)
    assert (magic, version) == (0xBA55ED50, 1), hex(magic)  # a fatbin container, version 1
    assert struct.unpack_from("<Q", data, 8)[0] == len(data) - header  # its size field covers the entries
    assert cubin.read_bytes() in data  # the cubin, uncompressed
