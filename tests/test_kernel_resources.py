"""Every kernel in the built extension can launch with the largest block
launch.cu gives it. A launch asks for registers for the whole block at once;
a kernel that the compiler gave too many registers fails at launch with "too
many resources requested" (error 701) on the GPU only, where no CPU test
would see it. The fused norm kernel did: 98 registers a thread allow 16 warps
on an H200, and it launches 17. So the limit is computed here from the
registers cuobjdump reports (the register file model of sm_80/sm_90: 65536
registers an SM in 4 scheduler partitions, allocated per warp in units of
256) and checked against the block sizes read from the sources."""
import glob
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cuobjdump():
    found = shutil.which("cuobjdump") or next(iter(glob.glob("/usr/local/cuda*/bin/cuobjdump")), None)
    if found:
        return found
    try:  # triton, which torch installs, ships one
        import triton

        bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        return bundled if os.path.exists(bundled) else None
    except ImportError:
        return None


def _define(path, name):
    text = open(os.path.join(ROOT, "csrc", path)).read()
    return int(re.search(rf"#define {name} (\d+)", text).group(1))


# The streamed kernels (stream.cuh) launch at most TPC_STREAM_WARPS_PER_BLOCK
# data warps (tpc_stream_geometry); every other kernel the largest block below.
STREAMED = ("tpc_all_reduce_stream_kernel", "tpc_all_gather_bulk_kernel")


def largest_block():
    """The most threads any other launch in launch.cu asks for: data threads plus the control warp."""
    control = _define("kernels/primitives.cuh", "TPC_CONTROL_THREADS")
    launch = open(os.path.join(ROOT, "csrc", "kernels", "launch.cu")).read()
    bulk = [int(n) for n in re.findall(r"tpc_geometry_for\([^;]*?, (\d+), TPC_MAX_BLOCKS\)", launch)]
    assert bulk, "launch.cu's bulk geometry changed: update this test"
    data = max(bulk + [_define("kernels/launch.cu", "TPC_PACKET_FAT_THREADS"),
                       _define("kernels/all_reduce_norm.cuh", "TPC_NORM_THREADS")])
    return data + control


def largest_streamed_block():
    launch = open(os.path.join(ROOT, "csrc", "kernels", "launch.cu")).read()
    assert "tpc_stream_geometry(args->nbytes / 16)" in launch, "launch.cu's stream geometry changed: update this test"
    return (_define("kernels/stream.cuh", "TPC_STREAM_WARPS_PER_BLOCK") * 32
            + _define("kernels/primitives.cuh", "TPC_CONTROL_THREADS"))


def max_threads_per_block(registers):
    if registers == 0:
        return 1024
    per_warp = -(-registers * 32 // 256) * 256
    warps_per_partition = 16384 // per_warp
    return min(1024, 4 * warps_per_partition * 32)


def test_register_model_matches_what_the_h200_reported():
    # measured on an H200 (cupy's max_threads_per_block for the fused kernel, 2026-11-30)
    assert max_threads_per_block(98) == 512
    assert max_threads_per_block(96) == 640
    assert max_threads_per_block(46) == 1024


def test_every_kernel_launches_with_its_largest_block():
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("needs cuobjdump (CUDA toolkit or triton)")
    from tpcomm import _lib

    path = _lib.library_path()
    out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kernels = re.findall(r"Function (\S*_kernel\S*):\s*\n\s*REG:(\d+)", out.stdout)
    names = {name for name, _ in kernels}
    assert len(names) >= 10, f"expected tpcomm's 10 kernels in {path}, found {sorted(names)}"
    assert all(any(s in n for n in names) for s in STREAMED), sorted(names)
    need, streamed = largest_block(), largest_streamed_block()
    assert (need, streamed) == (544, 288)
    too_big = {name: int(regs) for name, regs in kernels
               if max_threads_per_block(int(regs)) < (streamed if any(s in name for s in STREAMED) else need)}
    assert not too_big, f"kernels whose registers do not allow their largest block: {too_big}"
