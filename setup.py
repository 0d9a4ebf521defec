"""Builds tpcomm's extension against the torch in the environment.

The C core (csrc/core/*.c) is compiled as C11 by the C compiler and linked in
as objects; torch's BuildExtension compiles the CUDA C kernels (nvcc, or
hipcc after hipify on a ROCm torch) and the one C++ binding file.
CUDA targets default to 8.0 and 9.0 plus PTX; set TORCH_CUDA_ARCH_LIST to change.
On a ROCm torch the targets default to gfx90a and gfx942 (MI200, MI300); set
PYTORCH_ROCM_ARCH to change.

TPCOMM_CUDA_CLANG=clang-19 compiles the kernels with that clang instead of
nvcc, against the toolkit in CUDA_HOME (scripts/cuda12_toolkit.sh assembles a
CUDA 12 one from PyPI wheels, which ship no nvcc).

The version is python/tpcomm/_version.py's, with a local label naming the
GPU runtime the build links (0.1.0+cu130, 0.1.0+cu128, 0.1.0+rocm64), so
wheels for different CUDA majors are told apart; TPCOMM_VERSION_LABEL
replaces the label, and set empty drops it (PyPI takes no local labels).
"""
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

from setuptools import Extension, find_namespace_packages, setup

ROOT = Path(__file__).parent.resolve()
CORE_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "core").glob("*.c"))
# Linked into tpcomm._C with the core; csrc/compat/glibc.c says why.
COMPAT_SOURCES = ["csrc/compat/glibc.c"]
# Included first in every kernel compilation by clang (csrc/compat/clang_cuda.h).
CLANG_CUDA_PRELUDE = "csrc/compat/clang_cuda.h"
KERNEL_SOURCE = "csrc/kernels/launch.cu"
# Stable-ABI target: the oldest torch whose stable ops we use (contiguous, new_empty).
TORCH_TARGET = "-DTORCH_TARGET_VERSION=0x020a000000000000"


def _base_version():
    text = (ROOT / "python" / "tpcomm" / "_version.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"$', text, re.M).group(1)


def _cuda_version(gpu_include):
    """(major, minor) of the CUDA toolkit whose headers the build uses."""
    text = Path(gpu_include, "cuda.h").read_text(errors="replace")
    found = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", text)
    if not found:
        raise RuntimeError(f"{gpu_include}/cuda.h has no CUDA_VERSION")
    number = int(found.group(1))
    return number // 1000, number % 1000 // 10


def _version(rocm, gpu_include):
    label = os.environ.get("TPCOMM_VERSION_LABEL")
    if label is None:
        if rocm:
            import torch

            label = "rocm" + "".join(torch.version.hip.split(".")[:2])
        else:
            label = "cu%d%d" % _cuda_version(gpu_include)
    return _base_version() + (f"+{label}" if label else "")


# The torch each build label runs with (the wheel's one run-time requirement).
# torch's stable ABI starts at 2.10; PyPI's torch is built for CUDA 12.8 in
# 2.10 and for CUDA 13 from 2.11, and a wheel must load the CUDA runtime torch
# loads. Metadata cannot name torch's CUDA (a local label such as +cu128 is
# not part of a version range), so a torch of the right version built for
# another CUDA (pytorch.org's indexes) still installs: README's Support says so.
TORCH_REQUIREMENTS = {"cu13": "torch>=2.11", "cu128": "torch>=2.10,<2.11"}
TORCH_ANY = "torch>=2.10"  # source builds and other labels: the stable ABI's floor


def torch_requirement(version):
    """The torch requirement of a build whose version is `version` (with its label)."""
    label = version.partition("+")[2]
    for prefix, requirement in TORCH_REQUIREMENTS.items():
        if label.startswith(prefix):
            return requirement
    return TORCH_ANY


def _clang_cuda_arch_flags():
    """clang's flags for TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX"): a cubin per
    arch, PTX only where "+PTX" asks for it."""
    flags = ["--no-cuda-include-ptx=all"]
    for item in re.split(r"[;\s]+", os.environ["TORCH_CUDA_ARCH_LIST"].strip()):
        if not item:
            continue
        arch = item.replace("+PTX", "")
        if not re.fullmatch(r"\d+\.\d+a?", arch):
            raise RuntimeError(f"TORCH_CUDA_ARCH_LIST entry {item!r} is not like 9.0 or 9.0+PTX")
        sm = "sm_" + arch.replace(".", "")
        flags.append(f"--cuda-gpu-arch={sm}")
        if item.endswith("+PTX"):
            flags.append(f"--cuda-include-ptx={sm}")
    return flags


def _extension():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, ROCM_HOME, CUDAExtension

    rocm = torch.version.hip is not None
    if rocm:
        os.environ.setdefault("PYTORCH_ROCM_ARCH", "gfx90a;gfx942")
    else:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    macros = ["-DUSE_ROCM=1", "-D__HIP_PLATFORM_AMD__=1"] if rocm else ["-DUSE_CUDA"]
    gpu_home = ROCM_HOME if rocm else os.environ.get("CUDA_HOME") or CUDA_HOME
    gpu_include = os.path.join(gpu_home, "include")
    clang = None if rocm else os.environ.get("TPCOMM_CUDA_CLANG")
    binding = ["csrc/binding/ops.cpp", "csrc/binding/norm_ops.cpp"]
    sources = binding if clang else [KERNEL_SOURCE, *binding]
    ext = CUDAExtension(
        name="tpcomm._C",
        sources=sources,
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17", TORCH_TARGET, *macros],
            # --threads 0: one thread per target architecture (the kernels are one file, so
            # ninja's jobs alone would compile a wheel's sm_80 and sm_90 one after the other).
            "nvcc": ["-O3", "-std=c++17", "--threads", "0", TORCH_TARGET, *macros],
        },
        include_dirs=[gpu_include],
        py_limited_api=True,
    )
    return ext, gpu_home, gpu_include, macros, clang, _version(rocm, gpu_include)


# The eager fast path (csrc/binding/fastpath.c): a C module of the limited
# Python API, compiled by BuildWithCCore as C (torch's ninja build would hand
# a .c file to the C++ compiler).
FASTPATH = Extension("tpcomm._fastpath", sources=[], py_limited_api=True)
FASTPATH_SOURCE = "csrc/binding/fastpath.c"


def _drop_build_rpaths(compiler):
    """Removes the run paths Python's own link line carries (sysconfig's
    LDSHARED: a pyenv or conda lib directory of the build machine) from the
    compiler's link commands: the extension finds torch's libraries because
    torch loads them before it, and a shipped .so must not search the build
    machine's directories (readelf -d shows no RUNPATH)."""
    for attr in ("linker_so", "linker_so_cxx"):
        cmd = getattr(compiler, attr, None)
        if cmd:
            setattr(compiler, attr, [a for a in cmd if not a.startswith(("-Wl,-rpath", "-Wl,-R", "-R"))])


def _build_ext_class(gpu_home, gpu_include, macros, clang):
    from torch.utils.cpp_extension import BuildExtension

    class BuildWithCCore(BuildExtension):
        """Compiles the C core (into tpcomm._C) and the fast path module as
        C11, not as C++, and links their objects in; with TPCOMM_CUDA_CLANG,
        compiles the kernels with clang and links them in too."""

        def build_extensions(self):
            _drop_build_rpaths(self.compiler)
            super().build_extensions()

        def build_extension(self, ext):
            cc = os.environ.get("CC") or sysconfig.get_config_var("CC").split()[0] or "cc"
            out_dir = Path(self.build_temp) / "ccore"
            out_dir.mkdir(parents=True, exist_ok=True)
            fastpath = ext.name == FASTPATH.name
            sources = [FASTPATH_SOURCE] if fastpath else CORE_SOURCES + COMPAT_SOURCES
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
            if not clang:
                super().build_extension(ext)
                return
            # clang compiles the kernels while ninja compiles the binding; the link waits for both.
            kernels, obj = self._start_clang_kernels(out_dir)
            ext.extra_objects.append(obj)
            link = self.compiler.link_shared_object

            def link_after_kernels(*args, **kwargs):
                if kernels.wait() != 0:
                    raise subprocess.CalledProcessError(kernels.returncode, kernels.args)
                return link(*args, **kwargs)

            self.compiler.link_shared_object = link_after_kernels
            try:
                super().build_extension(ext)
            finally:
                self.compiler.link_shared_object = link
                if kernels.poll() is None:
                    kernels.kill()
                    kernels.wait()

        @staticmethod
        def _start_clang_kernels(out_dir):
            """Starts clang on the kernels: (the process, the object it writes)."""
            if shutil.which(clang) is None:
                raise RuntimeError(f"TPCOMM_CUDA_CLANG={clang}: no such compiler on PATH")
            obj = out_dir / "launch_clang.o"
            # CUDA_HOME's headers go first as -isystem: clang would otherwise
            # find another toolkit's under /usr/local/include before them.
            cmd = [clang, "-x", "cuda", f"--cuda-path={gpu_home}", "-isystem", gpu_include,
                   *_clang_cuda_arch_flags(), "-std=c++17", "-O3", "-fPIC", "-Wall", "-Werror",
                   "-Wno-unknown-cuda-version", *macros, "-I", str(ROOT / "csrc"),
                   "-include", str(ROOT / CLANG_CUDA_PRELUDE), "-c", str(ROOT / KERNEL_SOURCE), "-o", str(obj)]
            print(" ".join(cmd), flush=True)
            return subprocess.Popen(cmd), str(obj)

    return BuildWithCCore.with_options(use_ninja=True)


ext, gpu_home, gpu_include, macros, clang, version = _extension()
setup(
    version=version,
    install_requires=[torch_requirement(version)],
    package_dir={"": "python"},
    # Namespace packages too, so tpcomm.tables (JSON only) is a package whose
    # data setuptools installs as declared in pyproject.toml.
    packages=find_namespace_packages("python", include=["tpcomm", "tpcomm.*"], exclude=["*.__pycache__"]),
    ext_modules=[ext, FASTPATH],
    cmdclass={"build_ext": _build_ext_class(gpu_home, gpu_include, macros, clang)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
