"""Packaging: one source for the version, the CUDA label of a build, the
package's data and metadata, the source distribution's contents, the
library's glibc needs (manylinux_2_28), and the fatbinary stand-in that the
CUDA 12 build with clang uses."""
import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib

import pytest

import tpcomm
from tpcomm import _version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.dirname(os.path.abspath(tpcomm.__file__))
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
HAS_CUDA_HEADERS = os.path.exists(os.path.join(CUDA_HOME, "include", "cuda.h"))


def pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def setup_py(*args, **env):
    """`python setup.py ARGS` in the checkout (it imports torch to describe the extension).
    Commands that write egg-info are given egg_info --egg-base under a tmp dir:
    metadata left in python/ would pass for an installed tpcomm."""
    full_env = dict(os.environ, CUDA_HOME=CUDA_HOME, **env)
    return subprocess.run([sys.executable, "setup.py", *args], cwd=ROOT, capture_output=True, text=True,
                          env=full_env, timeout=600)


def test_one_source_for_the_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", _version.__version__)
    assert tpcomm.__version__ == _version.__version__
    project = pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    with open(os.path.join(ROOT, "setup.py")) as f:
        setup_text = f.read()
    assert not re.search(r"version\s*=\s*[\"']\d", setup_text), "setup.py writes a version of its own"


def test_changelog_has_this_version():
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        text = f.read()
    headings = re.findall(r"^## (\S+)", text, re.M)
    assert headings and headings[0] == _version.__version__, headings


@pytest.mark.skipif(not HAS_CUDA_HEADERS, reason=f"needs CUDA headers in {CUDA_HOME}")
def test_setup_labels_the_version_with_the_cuda_it_builds_for():
    with open(os.path.join(CUDA_HOME, "include", "cuda.h")) as f:
        number = int(re.search(r"#define\s+CUDA_VERSION\s+(\d+)", f.read()).group(1))
    label = f"cu{number // 1000}{number % 1000 // 10}"
    env = {k: v for k, v in os.environ.items() if k != "TPCOMM_VERSION_LABEL"}
    out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True,
                         env=dict(env, CUDA_HOME=CUDA_HOME), timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{_version.__version__}+{label}"
    plain = setup_py("--version", TPCOMM_VERSION_LABEL="")
    assert plain.stdout.strip().splitlines()[-1] == _version.__version__  # what PyPI takes
    other = setup_py("--version", TPCOMM_VERSION_LABEL="cu128")
    assert other.stdout.strip().splitlines()[-1] == f"{_version.__version__}+cu128"


def test_setup_globs_the_c_core():
    with open(os.path.join(ROOT, "setup.py")) as f:
        lines = f.read().splitlines()
    assert ('CORE_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "core").glob("*.c"))'
            in lines)


def test_metadata_names_every_collective_and_the_fused_op():
    project = pyproject()["project"]
    text = project["description"].lower()
    for what in ("all-reduce", "all-gather", "reduce-scatter", "rmsnorm"):
        assert what in text, what
    assert project["scripts"]["tpcomm"] == "tpcomm.cli:main"



def _setup_module():
    """setup.py's helpers without running setup(): its source up to the call."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        source = f.read().split("\next, gpu_home, gpu_include")[0]
    namespace = {"__file__": os.path.join(ROOT, "setup.py"), "__name__": "tpcomm_setup"}
    exec(compile(source, "setup.py", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("version,requirement", [("0.1.0+cu130", "torch>=2.11"), ("0.1.0+cu131", "torch>=2.11"),
                                                 ("0.1.0+cu128", "torch>=2.10,<2.11"), ("0.1.0", "torch>=2.10"),
                                                 ("0.1.0+rocm64", "torch>=2.10")])
def test_each_variant_requires_the_torch_it_runs_with(version, requirement):
    assert _setup_module()["torch_requirement"](version) == requirement


@pytest.mark.skipif(not HAS_CUDA_HEADERS, reason=f"needs CUDA headers in {CUDA_HOME}")
def test_metadata_requires_the_torch_of_the_build(tmp_path):
    out = setup_py("egg_info", "--egg-base", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    (requires,) = tmp_path.glob("*.egg-info/requires.txt")
    with open(os.path.join(CUDA_HOME, "include", "cuda.h")) as f:
        major = int(re.search(r"#define\s+CUDA_VERSION\s+(\d+)", f.read()).group(1)) // 1000
    always = requires.read_text().split("\n[", 1)[0].split()  # before the extras' sections
    assert always == (["torch>=2.11"] if major >= 13 else ["torch>=2.10,<2.11"])


def test_built_extension_carries_no_run_path():
    """The build drops the run paths of Python's link line (setup.py
    _drop_build_rpaths): a shipped library searches no build-machine dirs."""
    libraries = [os.path.join(PACKAGE_DIR, n) for n in os.listdir(PACKAGE_DIR) if n.endswith(".so")]
    if not libraries or shutil.which("readelf") is None:
        pytest.skip("needs a built extension (python setup.py build_ext --inplace, or an installed wheel) and readelf")
    for path in libraries:
        dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
        assert "RPATH" not in dynamic and "RUNPATH" not in dynamic, (path, dynamic)


@pytest.mark.skipif(not HAS_CUDA_HEADERS, reason=f"needs CUDA headers in {CUDA_HOME}")
def test_package_data_installs_without_layout_warnings(tmp_path):
    """The tables are declared package data of a package (tpcomm.tables), so
    setuptools installs them without 'Installing ... as data is deprecated'."""
    out = setup_py("egg_info", "--egg-base", str(tmp_path), "build_py", "-d", str(tmp_path / "lib"))
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "as data is deprecated" not in log and "is not a package" not in log, log[-3000:]
    built = tmp_path / "lib" / "tpcomm"
    tables = sorted(os.listdir(os.path.join(ROOT, "python", "tpcomm", "tables")))
    assert tables and sorted(os.listdir(built / "tables")) == tables
    assert (built / "py.typed").exists() and (built / "doctor" / "__init__.py").exists() and (built / "_version.py").exists()


@pytest.mark.skipif(not HAS_CUDA_HEADERS or shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")),
                    reason="needs CUDA headers and a git checkout")
def test_sdist_holds_the_sources_and_no_built_objects(tmp_path):
    out = setup_py("egg_info", "--egg-base", str(tmp_path), "sdist", "-d", str(tmp_path), TPCOMM_VERSION_LABEL="")
    assert out.returncode == 0, out.stderr[-3000:]
    (archive,) = tmp_path.glob("tpcomm-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    tracked = subprocess.run(["git", "ls-files", "csrc", "python/tpcomm", "scripts/cuda12"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    missing = [f for f in tracked if f not in names]
    assert not missing, missing
    for needed in ("setup.py", "pyproject.toml", "LICENSE", "CHANGELOG.md", "scripts/cuda12_toolkit.sh"):
        assert needed in names, needed
    assert not [n for n in names if n.endswith((".so", ".o", ".pyc"))]


def _glibc_needs(path):
    """{"GLIBC": max version, "GLIBCXX": ..., "CXXABI": ...} of the versioned symbols a library imports."""
    out = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
    needs = {}
    for line in out.splitlines():
        if "*UND*" not in line:
            continue
        found = re.search(r"\b(GLIBC|GLIBCXX|CXXABI)_([\d.]+)", line)
        if found:
            version = tuple(int(p) for p in found.group(2).split("."))
            needs[found.group(1)] = max(needs.get(found.group(1), ()), version)
    return needs


# manylinux_2_28: glibc 2.28, GCC 8's libstdc++ (GLIBCXX_3.4.25, CXXABI_1.3.11).
MANYLINUX_2_28 = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 25), "CXXABI": (1, 3, 11)}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_built_libraries_fit_manylinux_2_28():
    libraries = [os.path.join(PACKAGE_DIR, n) for n in os.listdir(PACKAGE_DIR) if n.endswith(".so")]
    if not libraries:
        pytest.skip(f"no built extension in {PACKAGE_DIR}")
    for path in libraries:
        for name, version in _glibc_needs(path).items():
            assert version <= MANYLINUX_2_28[name], f"{os.path.basename(path)} needs {name}_{version}"


@pytest.mark.skipif(shutil.which("objdump") is None or shutil.which("cc") is None, reason="needs objdump and cc")
def test_the_glibc_check_has_teeth(tmp_path):
    """A library that reads __libc_single_threaded from glibc (2.32) fails the
    check above; with csrc/compat/glibc.c linked in, it needs nothing past 2.28."""
    src = tmp_path / "t.c"
    src.write_text("extern char __libc_single_threaded;\nint single(void) { return __libc_single_threaded; }\n")
    plain = tmp_path / "plain.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(plain)], check=True)
    if _glibc_needs(str(plain)).get("GLIBC", ()) < (2, 32):
        pytest.skip("this glibc has no versioned __libc_single_threaded")
    fixed = tmp_path / "fixed.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(src), os.path.join(ROOT, "csrc", "compat", "glibc.c"), "-o",
                    str(fixed)], check=True)
    assert _glibc_needs(str(fixed)).get("GLIBC", ()) <= MANYLINUX_2_28["GLIBC"]


def load_fatbinary():
    path = os.path.join(ROOT, "scripts", "cuda12", "fatbinary")
    loader = importlib.machinery.SourceFileLoader("tpcomm_fatbinary", path)
    spec = importlib.util.spec_from_loader("tpcomm_fatbinary", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_fatbinary_reads_clangs_command_line():
    fatbinary = load_fatbinary()
    out, images = fatbinary.parse(["-64", "--create", "/tmp/k.fatbin", "--image=profile=sm_80,file=/tmp/a.cubin",
                                   "--image=profile=compute_90,file=/tmp/b.s"])
    assert out == "/tmp/k.fatbin"
    assert images == [("sm", "80", "/tmp/a.cubin"), ("compute", "90", "/tmp/b.s")]


@pytest.mark.parametrize("argv,needle", [(["--create", "o", "--compress-all", "--image=profile=sm_90,file=a"],
                                          "unsupported argument '--compress-all'"),
                                         (["--create", "o", "--image=profile=gfx90a,file=a"], "cannot use image"),
                                         (["--create", "o"], "usage")])
def test_fatbinary_refuses_what_it_does_not_know(argv, needle):
    with pytest.raises(SystemExit, match=needle):
        load_fatbinary().parse(argv)
