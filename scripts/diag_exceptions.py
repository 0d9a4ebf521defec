"""Device diagnostic: does an exception thrown by a stable-ABI op reach Python?
Each probe runs in its own process so a crash is reported, not fatal."""
import os
import subprocess
import sys
import sysconfig
import tempfile

import torch

SRC = r'''
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/csrc/stable/ops.h>
using torch::stable::Tensor;
Tensor boom(Tensor x, int64_t v) {
  Tensor out = torch::stable::empty_like(x);
  STD_TORCH_CHECK(v == 0, "boom ", v);
  return out;
}
Tensor boom_early(Tensor x, int64_t v) {
  STD_TORCH_CHECK(v == 0, "boom_early ", v);
  return x;
}
STABLE_TORCH_LIBRARY(exct, m) { m.def("boom(Tensor x, int v) -> Tensor"); m.def("boom_early(Tensor x, int v) -> Tensor"); }
STABLE_TORCH_LIBRARY_IMPL(exct, CPU, m) { m.impl("boom", TORCH_BOX(&boom)); m.impl("boom_early", TORCH_BOX(&boom_early)); }
STABLE_TORCH_LIBRARY_IMPL(exct, CUDA, m) { m.impl("boom", TORCH_BOX(&boom)); m.impl("boom_early", TORCH_BOX(&boom_early)); }
'''

PROBES = {
    "cpu_boom": "torch.ops.exct.boom(torch.ones(3), 1)",
    "cpu_boom_early": "torch.ops.exct.boom_early(torch.ones(3), 1)",
    "cuda_boom_early": "torch.ops.exct.boom_early(torch.ones(3, device='cuda'), 1)",
    "cuda_boom": "torch.ops.exct.boom(torch.ones(3, device='cuda'), 1)",
    "tpcomm_handle0": "import tpcomm; tpcomm.load(); torch.ops.tpcomm.custom_all_reduce(torch.ones(4, device='cuda'), 0, 0)",
}


def main():
    d = tempfile.mkdtemp()
    src = os.path.join(d, "t.cpp")
    open(src, "w").write(SRC)
    tdir = os.path.dirname(torch.__file__)
    so = os.path.join(d, "t.so")
    cmd = ["g++", "-std=c++17", "-shared", "-fPIC", "-O2", "-DTORCH_TARGET_VERSION=0x020a000000000000",
           f"-I{tdir}/include", src, f"-L{tdir}/lib", "-ltorch_cpu", "-lc10", "-o", so]
    subprocess.check_call(cmd)
    print("g++:", subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0])
    for name, stmt in PROBES.items():
        code = (f"import torch; torch.ops.load_library({so!r})\n"
                f"try:\n    {stmt}\n    print('no exception')\nexcept Exception as e:\n    print('caught', type(e).__name__, str(e)[:80])")
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True)
        print(f"{name:>18}: rc={r.returncode} {r.stdout.strip()} {r.stderr.strip()[-300:] if r.returncode else ''}")


if __name__ == "__main__":
    main()
