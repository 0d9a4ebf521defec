"""The same sources compile for AMD (scripts/rocm_compile.sh): every kernel
for gfx90a with hipcc, device code for gfx942 with clang-19, the
C core against the HIP headers, all with -Werror. It needs compilers that
pip cannot install, so it lives here, beside .ci/run, which installs them
with apt and runs it after the README's test command (which then skips
nothing but the GPU suite). No AMD GPU runs here."""
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A guard against a hung compiler, not a speed check: 15 minutes alone; .ci/run sets more where
# the check runs at the lowest priority beside the suite, which decides how much CPU it gets.
TIMEOUT_S = int(os.environ.get("TPCOMM_CI_ROCM_TIMEOUT_S", "900"))
MISSING = [tool for tool in ("hipcc", "clang-19", "gcc") if shutil.which(tool) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} "
                                "(apt-get install hipcc libamdhip64-dev rocm-device-libs clang-19; .ci/run does)")


def test_kernels_and_core_compile_for_amd(tmp_path):
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "rocm_compile.sh"), str(tmp_path)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "kernels: gfx90a" in proc.stdout and "kernels: gfx942" in proc.stdout
    core = [os.path.basename(c)[:-2] + ".o" for c in glob.glob(os.path.join(ROOT, "csrc", "core", "*.c"))]
    assert "runtime_gpu.o" in core
    for name in ("launch_gfx90a.o", "launch_gfx942.o", *core):
        assert (tmp_path / name).stat().st_size > 0, name


def test_cuda_only_code_fails_the_amd_build(tmp_path):
    """The check has teeth: inline PTX on the HIP path does not compile."""
    src = tmp_path / "ptx.cu"
    src.write_text('#include "kernels/portability.cuh"\n'
                   '__global__ void k(unsigned *p) { asm volatile("st.release.sys.global.u32 [%0], 1;" :: "l"(p)); }\n')
    proc = subprocess.run(["hipcc", "-x", "hip", "--offload-arch=gfx90a", "-Werror", "-D__HIP_PLATFORM_AMD__=1",
                           "-DUSE_ROCM=1", "-I", os.path.join(ROOT, "csrc"), "-c", str(src), "-o",
                           str(tmp_path / "ptx.o")], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, "PTX compiled for gfx90a"
