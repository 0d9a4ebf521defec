"""Builds tpcomm's extension against the torch in the environment.

The C core (csrc/core/*.c) is compiled as C11 by the C compiler and linked in
as objects; torch's BuildExtension compiles the CUDA C kernels (nvcc, or
hipcc after hipify on a ROCm torch) and the one C++ binding file.
CUDA targets default to 8.0 and 9.0 plus PTX; set TORCH_CUDA_ARCH_LIST to change.
On a ROCm torch the targets default to gfx90a and gfx942 (MI200, MI300); set
PYTORCH_ROCM_ARCH to change.
"""
import os
import subprocess
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup

ROOT = Path(__file__).parent.resolve()
CORE_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "core").glob("*.c"))
# Stable-ABI target: the oldest torch whose stable ops we use (contiguous, new_empty).
TORCH_TARGET = "-DTORCH_TARGET_VERSION=0x020a000000000000"


def _extension():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, ROCM_HOME, CUDAExtension

    rocm = torch.version.hip is not None
    if rocm:
        os.environ.setdefault("PYTORCH_ROCM_ARCH", "gfx90a;gfx942")
    else:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    macros = ["-DUSE_ROCM=1", "-D__HIP_PLATFORM_AMD__=1"] if rocm else ["-DUSE_CUDA"]
    gpu_include = os.path.join(ROCM_HOME if rocm else CUDA_HOME, "include")
    return CUDAExtension(
        name="tpcomm._C",
        sources=["csrc/kernels/launch.cu", "csrc/binding/ops.cpp"],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17", TORCH_TARGET, *macros],
            "nvcc": ["-O3", "-std=c++17", TORCH_TARGET, *macros],
        },
        include_dirs=[gpu_include],
        py_limited_api=True,
    ), gpu_include, macros


# The eager fast path (csrc/binding/fastpath.c): a C module of the limited
# Python API, compiled by BuildWithCCore as C (torch's ninja build would hand
# a .c file to the C++ compiler).
FASTPATH = Extension("tpcomm._fastpath", sources=[], py_limited_api=True)
FASTPATH_SOURCE = "csrc/binding/fastpath.c"


def _build_ext_class(gpu_include, macros):
    from torch.utils.cpp_extension import BuildExtension

    class BuildWithCCore(BuildExtension):
        """Compiles the C core (into tpcomm._C) and the fast path module as
        C11, not as C++, and links their objects in."""

        def build_extension(self, ext):
            cc = os.environ.get("CC") or sysconfig.get_config_var("CC").split()[0] or "cc"
            out_dir = Path(self.build_temp) / "ccore"
            out_dir.mkdir(parents=True, exist_ok=True)
            fastpath = ext.name == FASTPATH.name
            sources = [FASTPATH_SOURCE] if fastpath else CORE_SOURCES
            extra = [f"-I{sysconfig.get_paths()['include']}"] if fastpath else [f"-I{gpu_include}", *macros]
            objects = []
            for src in sources:
                obj = out_dir / (Path(src).stem + ".o")
                cmd = [cc, "-std=c11", "-O2", "-fPIC", "-Wall", "-Wextra", "-Werror", *extra,
                       "-c", str(ROOT / src), "-o", str(obj)]
                print(" ".join(cmd))
                subprocess.check_call(cmd)
                objects.append(str(obj))
            if fastpath:  # linked here too: torch's build refuses an extension without sources
                target = Path(self.get_ext_fullpath(ext.name))
                target.parent.mkdir(parents=True, exist_ok=True)
                subprocess.check_call([cc, "-shared", *objects, "-o", str(target)])
                return
            ext.extra_objects = list(ext.extra_objects or []) + objects
            super().build_extension(ext)

    return BuildWithCCore.with_options(use_ninja=True)


ext, gpu_include, macros = _extension()
setup(
    name="tpcomm",
    version="0.1.0",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[ext, FASTPATH],
    cmdclass={"build_ext": _build_ext_class(gpu_include, macros)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
